"""benchmarks/load_test.py on the tiny model, as a test: 200 concurrent streams (chat and
completions) equal offline generation with no 5xx and the KV blocks back to idle; a disconnect
storm (half of 200 streams dropped mid-way); and KV pressure (preemptions, results unchanged).
The script exits 1 on any failed check and prints which."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ("--mode", "load", "--num-requests", "200", "--rounds", "2", "--max-tokens", "24"),
    ("--mode", "disconnect", "--num-requests", "200", "--rounds", "1", "--max-tokens", "48", "--ignore-eos"),
    ("--mode", "kv-pressure", "--num-requests", "64", "--rounds", "1", "--max-tokens", "200", "--ignore-eos",
     "--num-kv-blocks", "48"),
], ids=["load", "disconnect", "kv-pressure"])
def test_load_test_passes_on_the_tiny_model(model_dir, flags):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", model_dir, *flags], capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "OK: every check passed" in proc.stdout
