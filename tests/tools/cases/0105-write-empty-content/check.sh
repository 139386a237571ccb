#!/bin/bash
set -euo pipefail
test -f e.txt && test ! -s e.txt
