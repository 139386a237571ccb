#!/bin/bash
set -euo pipefail
printf 'h\xc3\xa9llo' | cmp - out/x.txt
