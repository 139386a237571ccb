#!/bin/bash
set -euo pipefail
printf "const x = 'changed';\nconst y = 'other';\n" | cmp - f
