#!/usr/bin/env bash
# Offline DP on one machine under torchrun: NPROC ranks (default 2), one torch thread each.
#   launch/torchrun_generate.sh [extra args of launch/torchrun_generate.py]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
exec torchrun --standalone --nproc-per-node "$NPROC" launch/torchrun_generate.py "$@"
