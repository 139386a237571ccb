#!/bin/bash
set -euo pipefail
printf 'foo foo foo' | cmp - f.txt
