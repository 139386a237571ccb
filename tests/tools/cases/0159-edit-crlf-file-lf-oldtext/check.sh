#!/bin/bash
set -euo pipefail
printf 'line one\r\nline two\r\n' | cmp - f
