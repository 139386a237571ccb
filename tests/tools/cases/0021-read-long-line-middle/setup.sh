#!/bin/bash
set -euo pipefail
printf 'a\n' > f.txt; head -c 60000 /dev/zero | tr '\0' x >> f.txt; printf '\nb\n' >> f.txt
