"""The router's sharding policies and the wire format, on their own."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.policies import (
    CacheAware,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    image_digests,
    make_policy,
)
from deepinfer_dp.sampling_params import SamplingParams


def test_policies_pick_among_the_ranks_that_are_up():
    rr = RoundRobin()
    assert [rr.choose([1], {0: 0, 2: 0}) for _ in range(4)] == [0, 2, 0, 2]  # rank 1 is down
    assert LeastLoaded().choose([1], {0: 3, 1: 1, 2: 1}) == 1
    idle = LeastLoaded()  # ties go round: idle ranks share a light load
    assert [idle.choose([1], {0: 0, 1: 0, 2: 0}) for _ in range(4)] == [0, 1, 2, 0]
    affinity = PrefixAffinity(prefix_len=4, slack=2)
    home = affinity.choose([9, 9, 9, 9, 1], {0: 0, 1: 0})
    assert affinity.choose([9, 9, 9, 9, 2], {0: 0, 1: 0}) == home  # same prefix, same rank
    assert affinity.choose([9, 9, 9, 9, 3], {home: 5, 1 - home: 0}) == 1 - home  # too busy: elsewhere
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("fastest")


def _prompt(system: int, user: int) -> list[int]:
    """A 32-token shared system prompt `system` followed by an 8-token question `user`."""
    return [1000 + system] * 32 + [2000 + user] * 8


def test_cache_aware_sends_a_cached_prefix_home_and_spreads_new_ones():
    policy = CacheAware(block_size=8, cache_threshold=0.5, balance_abs_threshold=3)
    idle = {0: 0, 1: 0}
    first = policy.choose(_prompt(0, 0), idle)
    second = policy.choose(_prompt(1, 0), idle)  # not cached anywhere: equal loads take turns
    assert {first, second} == {0, 1}
    # a cached system prompt wins over load, up to the threshold
    assert [policy.choose(_prompt(0, u), {first: 2, second: 0}) for u in range(1, 4)] == [first] * 3
    assert policy.choose(_prompt(1, 9), {first: 0, second: 3}) == second
    # a prompt too short to match a whole block, or matching under cache_threshold: least loaded
    assert policy.choose([1000] * 7, {first: 1, second: 0}) == second
    assert policy.choose([1000] * 8 + [7] * 40, {first: 1, second: 0}) == second


def test_cache_aware_spreads_uncached_prompts_like_round_robin():
    policy, load, picks = CacheAware(block_size=8), {0: 0, 1: 0}, []
    for i in range(6):  # a burst: each request still in flight when the next comes
        picks.append(policy.choose([10 + i] * 3, load))
        load[picks[-1]] += 1
    assert picks == [0, 1, 0, 1, 0, 1]
    assert [policy.choose([10 + i] * 3, {0: 0, 1: 0}) for i in range(4)] == [0, 1, 0, 1]  # one at a time


def test_cache_aware_balances_when_the_load_is_out_of_both_thresholds():
    policy = CacheAware(block_size=8, balance_abs_threshold=3, balance_rel_threshold=1.5)
    home = policy.choose(_prompt(0, 0), {0: 0, 1: 0})
    other = 1 - home
    assert policy.choose(_prompt(0, 1), {home: 4, other: 2}) == home  # 2 above: within the absolute slack
    assert policy.choose(_prompt(0, 2), {home: 10, other: 7}) == home  # 3 above but under 1.5x
    assert policy.choose(_prompt(0, 3), {home: 11, other: 7}) == other  # 4 above and over 1.5x
    # the request placed by load is remembered there: both ranks now hold system prompt 0
    assert policy._matched_blocks(other, policy._block_hashes(_prompt(0, 5))) == 4


def test_cache_aware_forgets_a_rank_that_went_down_and_its_oldest_blocks():
    policy = CacheAware(block_size=8, capacity_blocks=5)
    home = policy.choose(_prompt(0, 0), {0: 0, 1: 0})
    assert policy.choose(_prompt(0, 1), {home: 0}) == home  # the other rank is down
    policy.choose(_prompt(1, 0), {home: 0})  # 5 blocks more on `home`: the oldest (system prompt 0) go
    assert policy._matched_blocks(home, policy._block_hashes(_prompt(0, 2))) == 0
    assert policy._matched_blocks(home, policy._block_hashes(_prompt(1, 1))) == 4
    other = 1 - home
    assert policy.choose(_prompt(1, 2), {home: 0, other: 0}) == home  # back up: home still has it
    assert policy.choose(_prompt(2, 0), {home: 1, other: 0}) == other  # a new prefix: least loaded
    assert policy._matched_blocks(other, policy._block_hashes(_prompt(2, 1))) == 4
    policy.choose(_prompt(3, 0), {home: 0})  # `other` is down again: its picture is dropped
    assert policy._cached.get(other) is None


def test_wire_format_is_msgpack_structs_only():
    params = SamplingParams(temperature=0.5, top_k=3, stop=["x"], max_tokens=7, seed=2**64 - 1)
    msg = p.rank_decoder.decode(p.encoder.encode(p.AddRequest("7", [1, 2], p.params_to_wire(params))))
    assert p.params_from_wire(msg.params) == params
    with pytest.raises(msgspec.ValidationError):  # anything but the declared messages is refused
        p.rank_decoder.decode(p.encoder.encode({"type": "Exec", "code": "import os"}))
    # Values are checked once, by the sender's InputProcessor (only key holders may send); the
    # rank trusts them, but a field SamplingParams does not have is still refused.
    with pytest.raises(TypeError):
        p.params_from_wire({**p.params_to_wire(params), "no_such_field": 1})


def test_prefix_affinity_keys_on_the_images_too():
    refs = [p.ImageRef(url="https://example.com/a.png"), p.ImageRef(data=b"\x89PNG...")]
    digests = image_digests(refs)
    assert digests == image_digests([p.ImageRef(url="https://example.com/a.png"), p.ImageRef(data=b"\x89PNG...")])
    affinity, load = PrefixAffinity(prefix_len=4), {0: 0, 1: 0}
    home = affinity.choose([5, 6, 7, 8], load, digests)
    assert all(affinity.choose([5, 6, 7, 8, i], load, digests) == home for i in range(8))  # same text, same images
    # the same text with other images is another key: over many images both ranks are used
    others = {affinity.choose([5, 6, 7, 8], load, image_digests([p.ImageRef(url=f"u{i}")])) for i in range(16)}
    assert others == {0, 1}


def test_a_request_with_images_on_the_wire_is_bounded():
    mm = p.images_to_wire("<image> hi", ["data:image/png;base64,AAAA", b"\x89PNG"], ["messages.0.content.1"], False)
    msg = p.rank_decoder.decode(p.encoder.encode(p.AddRequest("7", [1], {}, mm=mm)))
    assert p.images_from_wire(msg.mm) == ("<image> hi", ["data:image/png;base64,AAAA", b"\x89PNG"],
                                          ["messages.0.content.1"], False)
    too_many = p.ImageInputs("x", [p.ImageRef(url="u")] * (p.MAX_WIRE_IMAGES + 1))
    with pytest.raises(msgspec.ValidationError, match="length"):  # the inbox drops and counts such a frame
        p.rank_decoder.decode(p.encoder.encode(p.AddRequest("8", [1], {}, mm=too_many)))


def test_package_root_and_policies_import_without_torch_or_transformers():
    code = ("import sys, deepinfer_dp, deepinfer_dp.cluster.policies, deepinfer_dp.cluster.protocol\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert deepinfer_dp.SamplingParams is not None and 'torch' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_images_past_the_wire_bounds_are_refused_by_the_sender():
    with pytest.raises(ValueError, match="at most 64"):
        p.images_to_wire("x", ["u"] * (p.MAX_WIRE_IMAGES + 1), None, True)
    with pytest.raises(ValueError, match=r"^messages.0.content.1.image_url: .* characters"):
        p.images_to_wire("x", ["d" * (p.MAX_WIRE_IMAGE_BYTES + 1)], ["messages.0.content.1.image_url"], True)
    with pytest.raises(ValueError, match=r"^image 0: .* bytes"):
        p.images_to_wire("x", [b"d" * (p.MAX_WIRE_IMAGE_BYTES + 1)], None, True)
