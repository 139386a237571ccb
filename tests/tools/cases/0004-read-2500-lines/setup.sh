#!/bin/bash
set -euo pipefail
seq 1 2500 | sed 's/^/Line /' > f.txt
