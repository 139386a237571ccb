#!/bin/bash
set -euo pipefail
chmod 640 f.txt
