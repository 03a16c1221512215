"""large_outputs: a block past glibc's mmap threshold is reused only once no tensor or view
of it is alive."""

import threading

import torch

from deepinfer_dp.layers import large_outputs

ROWS, COLS = 64, 262_144  # Gemma 3's logits at 64 rows: 64 MiB


def test_small_outputs_are_plain_tensors():
    a = large_outputs.empty(4, 1000)
    assert a.shape == (4, 1000) and a.dtype == torch.float32 and a.is_contiguous()


def test_a_released_block_is_reused_and_a_held_one_is_not():
    a = large_outputs.empty(ROWS, COLS)
    ptr = a.data_ptr()
    b = large_outputs.empty(ROWS, COLS)  # a is alive: another block
    assert b.data_ptr() != ptr
    del a
    c = large_outputs.empty(ROWS, COLS)
    assert c.data_ptr() == ptr and c.shape == (ROWS, COLS)
    c.fill_(7.0)
    view = c[3:5].reshape(-1)  # a view keeps its block in use
    del c, b
    d = large_outputs.empty(ROWS, COLS)
    assert d.data_ptr() != ptr
    d.fill_(1.0)
    assert torch.all(view == 7.0)


def test_writes_to_a_new_tensor_never_reach_a_live_one():
    live = [large_outputs.empty(ROWS, COLS) for _ in range(large_outputs.KEEP_BLOCKS + 2)]
    for i, t in enumerate(live):
        t.fill_(float(i))
    for i, t in enumerate(live):
        assert t[0, 0].item() == i and t[-1, -1].item() == i
    assert large_outputs.kept_blocks() <= large_outputs.KEEP_BLOCKS


def test_a_smaller_request_takes_a_larger_free_block():
    a = large_outputs.empty(ROWS, COLS)
    ptr = a.data_ptr()
    del a
    b = large_outputs.empty(ROWS // 2 + 1, COLS)
    assert b.data_ptr() == ptr and b.shape == (ROWS // 2 + 1, COLS) and b.is_contiguous()


def test_threads_keep_pools_of_their_own():
    mine = large_outputs.empty(ROWS, COLS)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(large_outputs.empty(ROWS, COLS).data_ptr()))
    t.start()
    t.join()
    assert theirs[0] != mine.data_ptr()
