#!/bin/bash
set -euo pipefail
x=$(printf 'y%.0s' $(seq 60)); for i in $(seq 1000); do echo "$x"; done > f.txt
