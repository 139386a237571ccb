#!/bin/bash
set -euo pipefail
mkdir d && cd d && for i in $(seq -w 0 1000); do : > "f$i.txt"; done
