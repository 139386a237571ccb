#!/bin/bash
set -euo pipefail
for i in $(seq 50); do pgrep -f 'sleep 987.654' >/dev/null || exit 0; sleep 0.1; done
echo 'sleep 987.654 still running'; exit 1
