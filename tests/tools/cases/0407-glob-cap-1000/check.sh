#!/bin/bash
set -euo pipefail
# the first 1000 of the 1001 paths in byte order, then the cap note
expected=$(for i in $(seq -w 0 999); do echo "d/f0$i.txt"; done)
printf '%s\n\n[Showing the first 1000 of 1001 matching files, sorted by path. Narrow the pattern or the path to see the rest.]' "$expected" | cmp - "$RESULT_TEXT"
