#!/bin/bash
set -euo pipefail
printf 'def a():\n    return 2\n\ndef b():\n    return 1\n' | cmp - f.py
