#!/bin/bash
set -euo pipefail
echo needle > "$OUTSIDE/secret.txt"
ln -s "$OUTSIDE/secret.txt" link.txt
ln -s "$OUTSIDE" dirlink
ln -s real.txt inside-link.txt
