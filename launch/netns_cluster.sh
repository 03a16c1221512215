#!/usr/bin/env bash
# A multi-node Ray cluster on this one machine: a head and worker nodes, each in a Linux
# network namespace of its own (dinf-ID-head 10.213.0.1, dinf-ID-w1 10.213.0.2, ...) on a
# private bridge, Ray's token authentication on; then `deepinfer-dp serve` on the head against
# it. Needs root. The namespaces have no route out: traffic goes only between their addresses.
#   launch/netns_cluster.sh up ID [WORKERS]        # makes the namespaces, starts Ray (default 2 workers)
#   launch/netns_cluster.sh serve ID CONFIG [FLAGS] # serve in the head's namespace (foreground)
#   launch/netns_cluster.sh exec ID NODE CMD...     # any command in a node's namespace, with the token
#   launch/netns_cluster.sh down ID                 # kills every process in them, deletes them
#   launch/netns_cluster.sh leftovers               # lists dinf-* namespaces still there
# Example (the tiny model built as configs/tiny_test.yaml says):
#   launch/netns_cluster.sh up demo
#   launch/netns_cluster.sh serve demo configs/netns_tiny_dp2.yaml --model /tmp/deepinfer_dp_tiny/llama-gqa &
#   launch/netns_cluster.sh exec demo head curl -s 10.213.0.1:8000/health
#   launch/netns_cluster.sh down demo
# docs/multinode.md says what runs where and what each step checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CMD="${1:?usage: launch/netns_cluster.sh up|serve|exec|down|leftovers ...}"
shift
case "$CMD" in
  up|down|leftovers) exec "$PY" tests/netns_utils.py "$CMD" "$@" ;;
  serve|exec)
    ID="${1:?cluster id}"; shift
    NODE=head
    if [ "$CMD" = exec ]; then NODE="${1:?node}"; shift; fi
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="/tmp/dinf-$ID/token" HF_HUB_OFFLINE=1
    if [ "$CMD" = serve ]; then
      CONFIG="${1:?config}"; shift
      exec ip netns exec "dinf-$ID-$NODE" "$PY" -m deepinfer_dp.entrypoints.openai.launcher --config "$CONFIG" "$@"
    fi
    exec ip netns exec "dinf-$ID-$NODE" "$@" ;;
  *) echo "unknown command $CMD" >&2; exit 2 ;;
esac
