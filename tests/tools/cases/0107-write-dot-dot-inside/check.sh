#!/bin/bash
set -euo pipefail
printf c | cmp - b/c.txt
