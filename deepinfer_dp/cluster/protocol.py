"""Messages between the router and the DP ranks: msgspec structs in msgpack, tagged by type.

No pickle on the wire: a peer can only send these shapes. One PULL socket per rank (router
-> rank) and one PULL socket on the router (ranks -> router); both sides bind 127.0.0.1
unless a multi-node launcher gives another host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from deepinfer_dp.engine.client import TokenDelta
from deepinfer_dp.sampling_params import SamplingParams


# ---- router -> rank -------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields, see params_to_wire


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Wake(msgspec.Struct, tag=True):
    """Enter wave `wave` now (ignored when the rank is already past it)."""

    wave: int


class StatsQuery(msgspec.Struct, tag=True):
    query_id: int


class Reform(msgspec.Struct, tag=True):
    """Re-join a fresh DP group (after a peer failed) through the store at host:port."""

    host: str
    port: int
    group_rank: int
    world_size: int
    wave: int


class Shutdown(msgspec.Struct, tag=True):
    pass


# ---- rank -> router -------------------------------------------------------------------
class Deltas(msgspec.Struct, tag=True):
    """Everything one step produced on one rank (batched: one message per step)."""

    dp_rank: int
    deltas: list[TokenDelta]


class Rejected(msgspec.Struct, tag=True):
    dp_rank: int
    request_id: str
    message: str


class StartWave(msgspec.Struct, tag=True):
    """A request woke this rank: the router must wake every rank for `wave`."""

    dp_rank: int
    wave: int


class WaveDone(msgspec.Struct, tag=True):
    dp_rank: int
    wave: int


class Stats(msgspec.Struct, tag=True):
    dp_rank: int
    query_id: int
    stats: dict[str, Any]


class GroupBroken(msgspec.Struct, tag=True):
    """A collective of the DP group failed (a peer died); this rank waits for a Reform.
    `request_ids`: its requests the failure took down (a MoE collective fails mid-step)."""

    dp_rank: int
    wave: int
    message: str
    request_ids: list[str] = []


ToRank = AddRequest | Abort | Wake | StatsQuery | Reform | Shutdown
ToRouter = Deltas | Rejected | StartWave | WaveDone | Stats | GroupBroken

encoder = msgspec.msgpack.Encoder()
rank_decoder = msgspec.msgpack.Decoder(ToRank)
router_decoder = msgspec.msgpack.Decoder(ToRouter)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**fields)  # validates again on the rank


def delta_of(out, dp_rank: int) -> TokenDelta:
    """One pooled RequestOutput of a step as a TokenDelta (copies: the pool is reused)."""
    logprob = out.logprob
    return TokenDelta(request_id=out.request_id, token_ids=list(out.token_ids), finished=out.finished,
                      finish_reason=out.finish_reason if out.finished else None,
                      logprobs=None if logprob is None else [logprob], prompt_len=out.prompt_len,
                      output_len=out.output_len, dp_rank=dp_rank)
