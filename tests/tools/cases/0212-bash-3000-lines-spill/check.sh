#!/bin/bash
set -euo pipefail
spill=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["details"]["spill_path"])' "$RESULT_JSON")
seq 1 3000 | cmp - "$spill"
tail -n +2 "$RESULT_TEXT" | cmp - <(seq 1001 3000 | head -c -1)
head -n 1 "$RESULT_TEXT" | grep -qF "Full output: $spill "
