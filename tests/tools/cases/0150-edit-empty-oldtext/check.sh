#!/bin/bash
set -euo pipefail
printf 'file content' | cmp - a.txt
