#!/bin/bash
set -euo pipefail
rm -rf "$WS-other"
