#!/bin/bash
set -euo pipefail
seq 1 2000 | sed 's/^/L/' > f.txt
