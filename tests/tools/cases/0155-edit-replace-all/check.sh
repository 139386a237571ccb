#!/bin/bash
set -euo pipefail
printf 'c b c' | cmp - f
