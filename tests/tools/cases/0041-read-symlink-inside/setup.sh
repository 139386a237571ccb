#!/bin/bash
set -euo pipefail
mkdir sub && ln -s ../real.txt sub/link.txt
