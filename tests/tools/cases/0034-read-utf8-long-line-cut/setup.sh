#!/bin/bash
set -euo pipefail
{ printf a; printf 'é%.0s' $(seq 30000); echo; } > f.txt
