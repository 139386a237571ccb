#!/bin/bash
set -euo pipefail
test -d d
