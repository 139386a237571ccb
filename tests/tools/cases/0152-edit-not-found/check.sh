#!/bin/bash
set -euo pipefail
printf 'Hello, world!\n' | cmp - a.txt
