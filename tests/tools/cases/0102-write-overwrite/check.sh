#!/bin/bash
set -euo pipefail
printf new | cmp - f.txt
test "$(stat -c %a f.txt)" = 640
# the atomic write leaves no temporary file behind
test "$(ls -A | tr '\n' ' ')" = 'f.txt ' 
