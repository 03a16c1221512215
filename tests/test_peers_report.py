"""benchmarks/peers/report.py's shares of the machine: which peak our products are read against,
and the decode step's bytes per dtype."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "peers"))

from report import product_peak, shares  # noqa: E402

CEILINGS = {"matmul_gflops": 400.0, "read_gbs": 20.0, "fma_gflops": 500.0, "bf16_dot_gflops": 1000.0,
            "amx_gflops": 6000.0}
# One prompt of 100 tokens, 100 new: a mean context of 150 positions.
WORKLOAD = {"prompts": [[1] * 100], "max_tokens": 100}
COSTS = {"matmul_flops": 1e9, "attn_flops_per_position": 0.0, "weight_bytes": 1e9, "kv_bytes_per_position": 4e6}


def test_bf16_products_read_against_amx_where_the_cpu_has_it():
    assert product_peak(CEILINGS, bf16=False) == ("FMA", 500.0)
    assert product_peak(CEILINGS, bf16=True) == ("AMX", 6000.0)
    assert product_peak({**CEILINGS, "amx_gflops": 0.0}, bf16=True) == ("vdpbf16ps", 1000.0)
    assert "15% of the AMX peak (900 GFLOP/s)" in shares(900.0, WORKLOAD, COSTS, CEILINGS, bf16=True)
    assert "180% of the FMA peak (900 GFLOP/s)" in shares(900.0, WORKLOAD, COSTS, CEILINGS)


def test_bf16_steps_read_half_the_kv_bytes():
    # 10 tok/s of one prompt: 10 steps a second of 1 GB of weights + 150 positions x 4 MB (fp32),
    # 1.6 GB, against 20 GB/s: 80%; in bf16 150 x 2 MB: 1.3 GB, 65%.
    assert "80% of the read ceiling" in shares(10.0, WORKLOAD, COSTS, CEILINGS)
    assert "65% of the read ceiling" in shares(10.0, WORKLOAD, COSTS, CEILINGS, bf16=True)
