#!/bin/bash
set -euo pipefail
printf '\xef\xbb\xbffirst\r\nREPLACED\r\nthird\r\n' | cmp - f
