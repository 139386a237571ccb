#!/bin/bash
set -euo pipefail
mkdir directory
