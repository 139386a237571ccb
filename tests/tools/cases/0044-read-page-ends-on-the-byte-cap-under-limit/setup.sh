#!/bin/bash
set -euo pipefail
# line 1 has 512 x's, lines 2-100 have 511: the newline of line 100 is byte 51,201, the page's
# last byte (51,200 bytes of text); ten short lines follow
x=$(printf 'x%.0s' $(seq 511)); { echo "${x}x"; for i in $(seq 99); do echo "$x"; done; for i in $(seq 10); do echo y; done; } > f.txt
