#!/bin/bash
set -euo pipefail
test "$(cat "$OUTSIDE/canary.txt")" = canary
test "$(ls -A "$OUTSIDE")" = canary.txt
