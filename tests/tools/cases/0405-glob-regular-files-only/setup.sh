#!/bin/bash
set -euo pipefail
ln -s f.ts link.ts; mkfifo p.ts; ln -s "$OUTSIDE" out.ts; touch "$OUTSIDE/o.ts"
