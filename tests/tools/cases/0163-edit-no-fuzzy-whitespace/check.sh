#!/bin/bash
set -euo pipefail
printf 'line one   \nline two  \nline three\n' | cmp - f
