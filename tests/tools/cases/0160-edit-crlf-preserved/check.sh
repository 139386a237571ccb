#!/bin/bash
set -euo pipefail
printf 'first\r\nREPLACED\r\nthird\r\n' | cmp - f
