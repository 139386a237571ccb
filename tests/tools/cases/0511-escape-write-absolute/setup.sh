#!/bin/bash
set -euo pipefail
echo canary > "$OUTSIDE/canary.txt"
ln -s "$OUTSIDE/canary.txt" outlink
ln -s "$OUTSIDE" dirlink
ln -s / rootlink
ln -s "../../outside/$SANDBOX/canary.txt" rellink
