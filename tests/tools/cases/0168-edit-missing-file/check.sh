#!/bin/bash
set -euo pipefail
test ! -e nope.txt
