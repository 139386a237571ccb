#!/bin/bash
set -euo pipefail
seq 1 2000 | sed 's/^/L/' | head -c -1 | cmp - "$RESULT_TEXT" 
