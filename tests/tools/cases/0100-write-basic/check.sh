#!/bin/bash
set -euo pipefail
printf 'hello\n' | cmp - f.txt
