"""Messages between the router process, the DP ranks and the router's clients (API servers,
the offline driver): msgspec structs in msgpack, tagged by type.

No pickle on the wire: a peer can only send these shapes. Every process receives on one PULL
socket it binds, and sends with a PUSH socket to each peer's PULL: a rank's from the router,
the router's from the ranks and the clients, a client's from the router. Everything binds
127.0.0.1 unless a multi-node launcher gives another host; every socket is CURVE-authenticated
with its role's key (cluster/data_plane.py), and each inbox takes each message type only from
the role listed for it below (cluster/inbox.py).

    client -> router   Hello, AddRequest, Abort, StatsQuery, HealthQuery, Goodbye
    router -> rank     AddRequest, Abort, Wake, StatsQuery, Reform, Shutdown
    rank -> router     Deltas, Rejected, StartWave, WaveDone, Stats, GroupBroken, Reformed
    router -> client   Deltas, RequestError, StatsReply, HealthReply
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, get_args

import msgspec

from deepinfer_dp.cluster.data_plane import CLIENT, RANK, ROUTER
from deepinfer_dp.engine.client import TokenDelta
from deepinfer_dp.sampling_params import SamplingParams

# ---- to a rank (and AddRequest, Abort, StatsQuery from a client to the router) ---------
# Bounds of a request's images on the wire (a frame past them does not decode and is dropped);
# the rank's own limits (limit_mm_per_prompt, max_image_bytes) are checked by its image worker.
MAX_WIRE_IMAGES = 64
MAX_WIRE_IMAGE_BYTES = 64 * 2**20  # an encoded image, or a data URL's characters


class ImageRef(msgspec.Struct):
    """One image of a prompt: a URL (data:, http(s):, file:) the rank fetches, or encoded bytes."""

    url: Annotated[str, msgspec.Meta(max_length=MAX_WIRE_IMAGE_BYTES)] = ""
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_WIRE_IMAGE_BYTES)] = b""


class ImageInputs(msgspec.Struct):
    """A prompt with images (multimodal/image_worker.py's MultiModalPrompt): its text with the
    model's placeholders, and its images, which the rank's own image worker fetches."""

    prompt: str
    images: Annotated[list[ImageRef], msgspec.Meta(max_length=MAX_WIRE_IMAGES)]
    image_fields: Annotated[list[str], msgspec.Meta(max_length=MAX_WIRE_IMAGES)] | None = None
    max_tokens_set: bool = True


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields, see params_to_wire
    client_id: str = ""  # the client that sent it (the router's bookkeeping; ranks ignore it)
    mm: ImageInputs | None = None  # a prompt with images: the rank expands it (prompt_token_ids: unexpanded)
    dp_rank: int = -1  # the rank the client pinned it to (vLLM's data_parallel_rank); -1: the policy's choice


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]
    client_id: str = ""


class Wake(msgspec.Struct, tag=True):
    """Enter wave `wave` now (ignored when the rank is already past it)."""

    wave: int


class StatsQuery(msgspec.Struct, tag=True):
    query_id: int
    client_id: str = ""


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
    """Everything one step produced on one rank (batched: one message per step). The router
    passes each client its own requests' deltas in the same shape."""

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


class Reformed(msgspec.Struct, tag=True):
    """This rank joined the group of the Reform for `wave` (a scale waits for every member)."""

    dp_rank: int
    wave: int


# ---- client <-> router ----------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    """A client's first message: where the router sends its replies."""

    client_id: str
    address: str


class HealthQuery(msgspec.Struct, tag=True):
    """Also the client's heartbeat: a client silent for long is dropped, its requests aborted."""

    client_id: str
    query_id: int


class Goodbye(msgspec.Struct, tag=True):
    client_id: str


class RequestError(msgspec.Struct, tag=True):
    """The request ended without a result: kind "rejected" (bad input, 400), "no_capacity"
    (no rank up, 503) or "rank_failed" (its rank died, 503)."""

    request_id: str
    kind: str
    message: str


class StatsReply(msgspec.Struct, tag=True):
    query_id: int
    stats: list[dict[str, Any]]  # one per rank, in rank order
    router: dict[str, int] = {}  # the router's own counters: its dropped frames (Router.dropped_frames)


class HealthReply(msgspec.Struct, tag=True):
    query_id: int
    ranks: list[dict[str, Any]]  # {"dp_rank", "up", "inflight", "reason"} per rank
    group_failures: int = 0  # failed lockstep votes reported so far (each led to a re-form)
    router_id: str = ""  # this router process's; a new one means it restarted and lost its requests
    # the group's size and scaling (cluster/elastic.py): {"group_size", "scaling", "scale_events"}
    elastic: dict[str, Any] = {}


ToRank = AddRequest | Abort | Wake | StatsQuery | Reform | Shutdown
FromRank = Deltas | Rejected | StartWave | WaveDone | Stats | GroupBroken | Reformed
FromClient = Hello | AddRequest | Abort | StatsQuery | HealthQuery | Goodbye
ToClient = Deltas | RequestError | StatsReply | HealthReply

encoder = msgspec.msgpack.Encoder()
rank_decoder = msgspec.msgpack.Decoder(ToRank)
router_decoder = msgspec.msgpack.Decoder(FromRank)
frontend_decoder = msgspec.msgpack.Decoder(FromClient)
client_decoder = msgspec.msgpack.Decoder(ToClient)

# Who may send each message to each inbox (cluster/inbox.py checks every frame against these,
# and the ZAP handler admits only these roles' keys to the socket): a rank takes orders
# (Shutdown, Reform...) from the router alone; a client's inbox hears only the router.
TO_RANK_SENDERS = {t: (ROUTER,) for t in get_args(ToRank)}
FROM_RANK_SENDERS = {t: (RANK,) for t in get_args(FromRank)}
FROM_CLIENT_SENDERS = {t: (CLIENT,) for t in get_args(FromClient)}
TO_CLIENT_SENDERS = {t: (ROUTER,) for t in get_args(ToClient)}


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**fields)  # validated by the sender (engine/input_processor.py)


def images_to_wire(prompt: str, images: list[str | bytes], image_fields: list[str] | None,
                   max_tokens_set: bool) -> ImageInputs:
    """ValueError naming the image for what the wire would refuse: a frame past its bounds would
    be dropped by the router's inbox, and its request would never hear back."""
    if len(images) > MAX_WIRE_IMAGES:
        raise ValueError(f"{len(images)} images in one prompt; at most {MAX_WIRE_IMAGES} can be sent to the ranks")
    for i, image in enumerate(images):
        if len(image) > MAX_WIRE_IMAGE_BYTES:
            where = image_fields[i] if image_fields else f"image {i}"
            raise ValueError(f"{where}: {len(image)} {'characters' if isinstance(image, str) else 'bytes'}, more "
                             f"than the {MAX_WIRE_IMAGE_BYTES} an image sent to the ranks may have")
    refs = [ImageRef(url=i) if isinstance(i, str) else ImageRef(data=i) for i in images]
    return ImageInputs(prompt, refs, image_fields, max_tokens_set)


def images_from_wire(mm: ImageInputs) -> tuple[str, list[str | bytes], list[str] | None, bool]:
    """(prompt, images, image_fields, max_tokens_set): MultiModalPrompt's fields."""
    return mm.prompt, [r.data if r.data else r.url for r in mm.images], mm.image_fields, mm.max_tokens_set
