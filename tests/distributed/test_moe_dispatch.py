"""The expert-parallel dispatchers between two real processes over Gloo: with different
token counts per rank, each dispatcher's result equals the local computation of all experts,
the two dispatchers give the same bits, each rank counts only its own experts' real tokens;
and a peer that never enters the collective, or dies, makes the rank fail with
MoECollectiveError naming the rank, the layer and the timeout, within the timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from deepinfer_dp.distributed.groups import serve_store

EXPERTS, TOP_K, HIDDEN, INTER = 16, 4, 64, 48


def _weights():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.1,
            torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.1)


def _tokens(rank: int, count: int):
    from deepinfer_dp.layers.moe import select_experts

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, HIDDEN, generator=gen)
    ids, weights = select_experts(torch.randn(count, EXPERTS, generator=gen), TOP_K, renormalize=True)
    return x, ids, weights


def _layer(shard: tuple[int, int]):
    from deepinfer_dp.layers.moe import FusedMoE

    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, layer_index=7, shard=shard)
    w13, w2 = _weights()
    with torch.no_grad():
        layer.w13.copy_(w13[layer.first_expert:layer.end_expert])
        layer.w2.copy_(w2[layer.first_expert:layer.end_expert])
    return layer


def _join(rank: int, port: int, timeout_s: float):
    from deepinfer_dp.distributed import init_dp_groups
    from deepinfer_dp.distributed.moe_dispatch import init_ep_group

    return init_ep_group(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=timeout_s))


CASES = [(9, 3), (40, 1), (1, 1)]  # tokens on rank 0, rank 1
BACKENDS = ("all_to_all", "allgather_reducescatter")


def _dispatch_worker(rank: int, port: int, out) -> None:
    """Every case with both dispatchers, in one process pair (starting processes is slow)."""
    from deepinfer_dp.distributed.moe_dispatch import make_dispatcher

    torch.set_num_threads(1)
    ep = _join(rank, port, 30)
    results = {}
    for counts in CASES:
        x, ids, weights = _tokens(rank, counts[rank])
        for backend in BACKENDS:
            layer = _layer((rank, 2))
            layer.dispatcher = make_dispatcher(backend, ep, EXPERTS)
            outputs = []
            with torch.inference_mode():
                for counted in (True, rank == 0):  # rank 1's second call is a placeholder step's
                    layer.dispatcher.begin_step(x.shape[0])
                    outputs.append(layer(x, ids, weights, counted).numpy())
            results[counts, backend] = (outputs, layer.expert_tokens.tolist())
    out.put((rank, results))


def _run(target, *args, expect: tuple[int, ...] = (0, 1), timeout: float = 120):
    """Runs target(rank, store port, *args, queue) in two processes; {rank: what it put}."""
    store = serve_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.port, *args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = {}
        deadline = time.monotonic() + timeout
        while not set(expect) <= set(got) and time.monotonic() < deadline:
            rank, *rest = out.get(timeout=max(1.0, deadline - time.monotonic()))
            got[rank] = rest
        return got
    finally:
        for rank, proc in enumerate(procs):
            proc.join(timeout=30 if rank in expect else 1)  # a rank not expected to answer is ended
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.fixture(scope="module")
def dispatched() -> dict:
    """{rank: {(counts, backend): ([output of each call], expert_tokens)}}"""
    got = _run(_dispatch_worker)
    return {rank: got[rank][0] for rank in (0, 1)}


@pytest.mark.parametrize("counts", CASES)
def test_dispatch_equals_local_experts(dispatched, counts):
    full = _layer((0, 1))
    for rank in (0, 1):
        x, ids, weights = _tokens(rank, counts[rank])
        with torch.inference_mode():
            local = full.compute(x, ids, weights, counted=False)
        for backend in BACKENDS:
            for result in dispatched[rank][counts, backend][0]:
                assert (torch.from_numpy(result) - local).abs().max().item() < 1e-5, (backend, rank)


@pytest.mark.parametrize("counts", CASES)
def test_both_dispatchers_give_the_same_bits(dispatched, counts):
    for rank in (0, 1):
        for a, b in zip(*(dispatched[rank][counts, backend][0] for backend in BACKENDS), strict=True):
            assert (a == b).all()


@pytest.mark.parametrize("counts", CASES)
def test_each_rank_counts_its_own_experts_real_tokens(dispatched, counts):
    slots = torch.zeros(EXPERTS, dtype=torch.int64)
    for rank, calls in ((0, 2), (1, 1)):  # rank 1's second call was a placeholder step's
        _, ids, _ = _tokens(rank, counts[rank])
        slots += calls * torch.bincount(ids.reshape(-1).long(), minlength=EXPERTS)
    for backend in BACKENDS:
        rank0, rank1 = (torch.tensor(dispatched[r][counts, backend][1]) for r in (0, 1))
        assert rank0[8:].sum() == 0 and rank1[:8].sum() == 0  # only their own experts
        assert torch.equal(rank0 + rank1, slots)


# ---- a peer that misses the collective ---------------------------------------------------
def _failing_worker(rank: int, port: int, backend: str, mode: str, out) -> None:
    from deepinfer_dp.distributed.moe_dispatch import MoECollectiveError, make_dispatcher

    ep = _join(rank, port, 3)
    layer = _layer((rank, 2))
    layer.dispatcher = make_dispatcher(backend, ep, EXPERTS)
    x, ids, weights = _tokens(rank, 5)
    for step in range(1000):
        if rank == 1 and step == 2:
            if mode == "die":
                os._exit(1)
            time.sleep(30)  # alive, but it stopped stepping
            os._exit(0)
        start = time.monotonic()
        try:
            with torch.inference_mode():
                layer.dispatcher.begin_step(5)
                layer(x, ids, weights)
        except MoECollectiveError as e:
            out.put((rank, str(e), time.monotonic() - start))
            return
    out.put((rank, "no error", 0.0))


@pytest.mark.parametrize(("backend", "mode"), [("all_to_all", "stuck"), ("allgather_reducescatter", "die")])
def test_missing_peer_is_a_named_error_within_the_timeout(backend, mode):
    got = _run(_failing_worker, backend, mode, expect=(0,), timeout=60)
    message, waited = got[0]
    assert message.startswith("DP rank 0 of 2: the MoE ")
    where = "the start of the step" if backend == "allgather_reducescatter" else "layer 7"
    assert where in message and "collective timeout 3s" in message and "peer rank(s) [1]" in message
    assert waited < 3 + 5
