#!/usr/bin/env bash
# Serving on this machine through the router process: DP ranks and the router as Ray actors,
# and API_SERVERS API server processes sharing one port (vLLM's --api-server-count).
#   launch/serve_cluster.sh [CONFIG] [extra flags of `deepinfer-dp serve`]
#   API_SERVERS=2 launch/serve_cluster.sh configs/smollm2_dp2.yaml --port 8000
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's venv (launch/setup.sh) unless PYTHON names another interpreter.
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CONFIG="${1:-configs/smollm2_dp2.yaml}"
shift || true
exec "$PY" -m deepinfer_dp.entrypoints.openai.launcher --config "$CONFIG" \
  --api-server-count "${API_SERVERS:-2}" "$@"
