#!/bin/bash
set -euo pipefail
printf 'Xa' | cmp - f
