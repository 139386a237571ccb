#!/bin/bash
set -euo pipefail
printf 'Hello, testing!\n' | cmp - a.txt
