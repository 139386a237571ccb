#!/bin/bash
set -euo pipefail
seq 1 2500 > f.txt
