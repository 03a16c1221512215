#!/usr/bin/env bash
# Offline DP on one machine under torchrun: NPROC ranks (default 2), one torch thread each.
# torchrun's agent listens on every interface (unauthenticated stores): docs/reliability.md#security.
#   launch/torchrun_generate.sh [extra args of launch/torchrun_generate.py]
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's venv (launch/setup.sh) unless PYTHON names another interpreter.
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
NPROC="${NPROC:-2}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" launch/torchrun_generate.py "$@"
