#!/bin/bash
set -euo pipefail
seq 1 2000 | head -c -1 | cmp - "$RESULT_TEXT"; test ! -e .cflue/spill || test -z "$(ls -A .cflue/spill)"
