#!/bin/bash
set -euo pipefail
seq 1001 3000 | head -c -1 | cmp - "$RESULT_TEXT"
