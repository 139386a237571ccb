#!/bin/bash
set -euo pipefail
chmod 755 run.sh
