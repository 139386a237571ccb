#!/bin/bash
set -euo pipefail
test "$(stat -c %a run.sh)" = 755 && grep -q 'echo two' run.sh
test "$(ls -A | tr '\n' ' ')" = 'run.sh ' 
