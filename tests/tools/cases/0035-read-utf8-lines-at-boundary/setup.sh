#!/bin/bash
set -euo pipefail
x=$(printf '€%.0s' $(seq 100)); for i in $(seq 200); do echo "$x"; done > f.txt
