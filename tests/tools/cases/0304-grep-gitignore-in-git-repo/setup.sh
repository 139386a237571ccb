#!/bin/bash
set -euo pipefail
git init -q .
