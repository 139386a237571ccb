#!/bin/bash
set -euo pipefail
printf 'hello\r\nworld\r\n---\r\nX\n' | cmp - f
