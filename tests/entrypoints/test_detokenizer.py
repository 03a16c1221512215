"""Incremental detokenization and server-side stop strings, token by token."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from model_utils import build_tiny_tokenizer  # noqa: E402

from deepinfer_dp.entrypoints.openai.detokenizer import IncrementalDetokenizer  # noqa: E402
from deepinfer_dp.entrypoints.openai.stop_watch import StopWatch  # noqa: E402

TEXTS = ["héllo wörld, 世界 🤖🦾 ok", "naïve café — “quotes” ✓", "🤖" * 5, "plain ascii text, nothing odd"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_join_to_one_shot_decode(tokenizer, text, chunk):
    ids = tokenizer(text).input_ids
    assert len(ids) > len(text) // 2  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character on the wire


def test_unfinished_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer("ok 🤖").input_ids[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids) and text.endswith("\ufffd")


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("hi").input_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == "hi"


def test_stop_watch_holds_back_a_possible_stop_start():
    w = StopWatch(["STOP"])
    assert w.feed("abcST", False) == "ab"  # the last len("STOP") - 1 characters wait
    assert w.feed("x", False) == "c"
    w = StopWatch(["STOP"])
    out = [w.feed(c, False) for c in "hello STOP world"]
    assert "".join(out) == "hello " and w.stopped


def test_stop_watch_earliest_stop_and_release_at_end():
    w = StopWatch(["cd", "b"])
    assert w.feed("abcd", False) == "a" and w.stopped
    w = StopWatch(["zz"])
    assert w.feed("abz", False) == "ab"
    assert w.feed("", True) == "z" and not w.stopped
