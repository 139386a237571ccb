#!/bin/bash
set -euo pipefail
{ seq -w 0 999 | sed 's#^#d/f0#; s#$#.txt#' | sed 's#d/f0\(....\)\.#d/f\1.#'; } >/dev/null
{ for i in $(seq -w 0 1000); do echo "d/f$i.txt"; done | head -n 1000 | head -c -1; printf '\n\n[Showing the first 1000 of 1001 matching files, sorted by path. Narrow the pattern or the path to see the rest.]'; } | cmp - "$RESULT_TEXT" 
