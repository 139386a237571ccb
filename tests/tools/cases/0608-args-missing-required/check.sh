#!/bin/bash
set -euo pipefail
test ! -e x.txt
