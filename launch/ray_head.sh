#!/usr/bin/env bash
# Starts a Ray head node on this machine; DP deployments then join it with ray.address=auto
# (config) or --ray-address auto (CLI). To stop it, kill the head's own processes by PID
# (Ray's global stop command would end every Ray process on the machine, not just this head).
#   launch/ray_head.sh [NUM_CPUS] [NUM_GPUS]
# Ray's token authentication is on: the token is made once (~/.ray/auth_token) and every other
# node and every driver needs the same one (copy the file, or set RAY_AUTH_TOKEN).
# HEAD_IP=127.0.0.1 (one machine, the default): Ray's processes listen on 127.0.0.1 only.
set -euo pipefail
export RAY_AUTH_MODE=token
NUM_CPUS="${1:-$(nproc)}"
NUM_GPUS="${2:-0}"
HEAD_IP="${HEAD_IP:-127.0.0.1}"     # the address workers reach; 127.0.0.1 for one machine
if [ "$HEAD_IP" = 127.0.0.1 ]; then
  # Ray takes 127.0.0.1 as this node's address only on its single-machine setting; else it
  # swaps in the machine's address and binds every interface.
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
fi
ray get-auth-token --generate >/dev/null   # makes ~/.ray/auth_token unless there is one
PORT="${RAY_PORT:-6379}"
exec ray start --head --node-ip-address "$HEAD_IP" --port "$PORT" --num-cpus "$NUM_CPUS" \
  --num-gpus "$NUM_GPUS" --include-dashboard false --object-store-memory $((100 * 1024 * 1024)) \
  --temp-dir "${RAY_TEMP_DIR:-/tmp/ray_dp}"
