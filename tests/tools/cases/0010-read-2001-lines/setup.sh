#!/bin/bash
set -euo pipefail
seq 1 2001 | sed 's/^/L/' > f.txt
