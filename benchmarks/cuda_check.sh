#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU, run from the repository root:
#   bash benchmarks/cuda_check.sh OUT_DIR [SMOLLM2_CONFIG_DIR]
# 1. builds the C++ core; 2. tests/engine/test_cuda.py (fp32 token-identical to transformers on the
# GPU, bf16, ZOS on/off, preemption, seeded sampling); 3. DP=2 under torchrun, both ranks on
# one GPU (ZOS on: the lockstep vote rides the CPU group), compared with DP=1; then MoE expert
# parallelism on the GPU (tests/distributed/test_moe_cuda.py); 4. the offline
# throughput benchmark against transformers on the GPU, on a SmolLM2-shaped model with random
# weights built from SMOLLM2_CONFIG_DIR (config and tokenizer files; the speed of a model
# depends on its shape, not its weights).
set -u
OUT=${1:-/tmp/cuda_check}
SMOL=${2:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v WARNING | tail -3
python3 -c "import deepinfer_dp._C" || exit 1

echo "== tests/engine/test_cuda.py"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -25

echo "== DP=2 under torchrun on one GPU"
python3 -c "import sys; sys.path.insert(0, 'tests'); from model_utils import build_tiny_model; \
build_tiny_model('llama-gqa', '/tmp/tiny-llama')"
timeout 120 torchrun --nproc-per-node 2 launch/torchrun_generate.py --model /tmp/tiny-llama --device cuda:0 \
  --dtype float32 --shard-sizes 7,1 --max-tokens 16 --output "$OUT/dp2.json" 2>&1 | tail -4
timeout 120 python3 - "$OUT/dp2.json" <<'PY'
import json, sys
sys.path.insert(0, "launch")
from torchrun_generate import DEFAULT_PROMPTS
from deepinfer_dp import LLM, SamplingParams
llm = LLM("/tmp/tiny-llama", decode_sequence=False, device="cuda:0", dtype="float32")
outs = llm.generate(DEFAULT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
ids = [[t for o in per for t in o.token_ids] for per in outs]
dp = json.load(open(sys.argv[1]))
print("DP=2 outputs equal DP=1:", dp["token_ids"] == ids)
print("rank stats:", [(s["dp_rank"], s["generate_step"], s["placeholder_steps"]) for s in dp["rank_stats"]])
PY

echo "== MoE expert parallelism on CUDA (two ranks on the one GPU; NCCL too with two GPUs)"
timeout 600 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_moe_cuda.py 2>&1 \
  | tee "$OUT/test_moe_cuda.log" | tail -15

if [ -n "$SMOL" ]; then
  echo "== offline throughput on the GPU (SmolLM2 shape, random weights)"
  python3 - "$SMOL" <<'PY'
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1], "/tmp/smol-random"
shutil.copytree(src, dst, dirs_exist_ok=True)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(dst)
PY
  timeout 300 python3 benchmarks/offline_throughput.py --model /tmp/smol-random --device cuda --rounds 1 \
    --points 64 8 256 2>&1 | tee "$OUT/throughput.log"
fi
