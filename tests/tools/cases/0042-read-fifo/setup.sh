#!/bin/bash
set -euo pipefail
mkfifo p.txt
