#!/bin/bash
set -euo pipefail
head -c 51200 /dev/zero | tr '\0' x > f.txt; echo >> f.txt
