#!/bin/bash
set -euo pipefail
mkdir d
