#!/bin/bash
set -euo pipefail
printf 's1\ns2\ns3\n' > f.txt; head -c 60000 /dev/zero | tr '\0' x >> f.txt
