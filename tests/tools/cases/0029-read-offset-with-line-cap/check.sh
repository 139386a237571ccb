#!/bin/bash
set -euo pipefail
{ seq 300 2299; printf '\n[Showing lines 300-2299 of 2500. Use offset=2300 to continue.]'; } | cmp - "$RESULT_TEXT" 
