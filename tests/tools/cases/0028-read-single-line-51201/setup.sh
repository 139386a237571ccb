#!/bin/bash
set -euo pipefail
head -c 51201 /dev/zero | tr '\0' x > f.txt; echo >> f.txt
