#!/bin/bash
set -euo pipefail
test "$(stat -c %s "$RESULT_TEXT")" = 51200 && head -c 51200 f.txt | cmp - "$RESULT_TEXT"
