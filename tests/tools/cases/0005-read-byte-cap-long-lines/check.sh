#!/bin/bash
set -euo pipefail
x=$(printf 'x%.0s' $(seq 200)); { for i in $(seq 1 243); do printf 'Line %d: %s\n' "$i" "$x"; done; printf '\n[Showing lines 1-243 of 500. Use offset=244 to continue.]'; } | cmp - "$RESULT_TEXT" 
