#!/usr/bin/env bash
# Joins this machine to the Ray head started by launch/ray_head.sh on HEAD_IP.
#   HEAD_IP=10.0.0.1 launch/ray_worker.sh [NUM_CPUS] [NUM_GPUS]
# Needs the head's token (its ~/.ray/auth_token copied here, or RAY_AUTH_TOKEN set).
set -euo pipefail
export RAY_AUTH_MODE=token
: "${HEAD_IP:?set HEAD_IP to the head node's address}"
NUM_CPUS="${1:-$(nproc)}"
NUM_GPUS="${2:-0}"
exec ray start --address "$HEAD_IP:${RAY_PORT:-6379}" --num-cpus "$NUM_CPUS" --num-gpus "$NUM_GPUS" \
  --object-store-memory $((100 * 1024 * 1024))
