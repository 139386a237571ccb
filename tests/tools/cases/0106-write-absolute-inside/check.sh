#!/bin/bash
set -euo pipefail
printf ab | cmp - abs.txt
