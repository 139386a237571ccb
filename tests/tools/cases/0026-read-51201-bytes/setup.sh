#!/bin/bash
set -euo pipefail
x=$(printf 'x%.0s' $(seq 1023)); for i in $(seq 49); do echo "$x"; done > f.txt; echo "${x}xx" >> f.txt
