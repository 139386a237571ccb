#!/bin/bash
set -euo pipefail
x=$(printf 'x%.0s' $(seq 200)); for i in $(seq 1 500); do printf 'Line %d: %s\n' "$i" "$x"; done > f.txt
