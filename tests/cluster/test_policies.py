"""The router's sharding policies and the wire format, on their own."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.policies import LeastLoaded, PrefixAffinity, RoundRobin, image_digests, make_policy
from deepinfer_dp.sampling_params import SamplingParams


def test_policies_pick_among_the_ranks_that_are_up():
    rr = RoundRobin()
    assert [rr.choose([1], {0: 0, 2: 0}) for _ in range(4)] == [0, 2, 0, 2]  # rank 1 is down
    assert LeastLoaded().choose([1], {0: 3, 1: 1, 2: 1}) == 1
    affinity = PrefixAffinity(prefix_len=4, slack=2)
    home = affinity.choose([9, 9, 9, 9, 1], {0: 0, 1: 0})
    assert affinity.choose([9, 9, 9, 9, 2], {0: 0, 1: 0}) == home  # same prefix, same rank
    assert affinity.choose([9, 9, 9, 9, 3], {home: 5, 1 - home: 0}) == 1 - home  # too busy: elsewhere
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("fastest")


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
