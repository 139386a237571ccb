#!/bin/bash
set -euo pipefail
printf 'a b a' | cmp - f
