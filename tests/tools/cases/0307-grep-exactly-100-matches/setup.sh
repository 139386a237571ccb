#!/bin/bash
set -euo pipefail
for i in $(seq 100); do echo "match $i"; done > m.txt
