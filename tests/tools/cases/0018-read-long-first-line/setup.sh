#!/bin/bash
set -euo pipefail
head -c 60000 /dev/zero | tr '\0' x > f.txt
