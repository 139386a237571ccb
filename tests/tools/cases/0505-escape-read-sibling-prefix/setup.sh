#!/bin/bash
set -euo pipefail
mkdir -p "$WS-other" && echo secret > "$WS-other/f.txt"
