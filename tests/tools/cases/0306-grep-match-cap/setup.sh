#!/bin/bash
set -euo pipefail
for i in $(seq 50); do echo "match c$i"; done > c.txt
for i in $(seq 60); do echo "match a$i"; done > a.txt
for i in $(seq 40); do echo "match b$i"; done > b.txt
