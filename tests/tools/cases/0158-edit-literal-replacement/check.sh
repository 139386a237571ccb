#!/bin/bash
set -euo pipefail
printf 'a $&$&\\1 b' | cmp - f
