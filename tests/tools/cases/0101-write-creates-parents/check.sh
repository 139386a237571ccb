#!/bin/bash
set -euo pipefail
test -d output/nested/deep && printf done | cmp - output/nested/deep/result.txt
