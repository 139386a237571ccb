#!/bin/bash
set -euo pipefail
# a minified file: a match on a line of 100,000 bytes, longer than what toold keeps of an
# engine's output line, then a short one
{ printf 'needle'; head -c 100000 /dev/zero | tr '\0' x; printf '\nneedle again\n'; } > min.js
