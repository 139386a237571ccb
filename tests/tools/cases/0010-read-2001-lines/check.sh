#!/bin/bash
set -euo pipefail
{ seq 1 2000 | sed 's/^/L/'; printf '\n[Showing lines 1-2000 of 2001. Use offset=2001 to continue.]'; } | cmp - "$RESULT_TEXT" 
