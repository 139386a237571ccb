#!/bin/bash
set -euo pipefail
printf 'Hello bye HELLO' | cmp - f
