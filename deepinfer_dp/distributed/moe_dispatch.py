"""Expert parallelism over the DP group: each MoE layer sends every token to the ranks that
own its top-k experts and sums their results back. This is the collective inside the model
that the lockstep vote and the placeholder steps exist for: every rank must enter it at
every MoE layer of every step, an idle rank with its placeholder step's dummy token.

Two dispatchers behind one interface (`dispatch_combine`), chosen by `all2all_backend`:
  all_to_all               the ranks exchange how many rows each sends each other (split
                           sizes differ per rank and per layer), then one all-to-all carries
                           each token once to every rank owning one of its experts, a second
                           one carries each rank's partial sums back;
  allgather_reducescatter  every rank gathers every rank's tokens (padded to the step's
                           largest token count, exchanged once per step), computes its
                           experts' share for all of them, and a reduce-scatter sums the
                           shares and hands each rank its own rows.
A token's result is the sum over ranks of each rank's share, its own experts' slots in slot
order; for two ranks both dispatchers give the very same bits.

The collectives run on an EP group of their own: on the CPU the forward runs on the rank's
compute thread while its host thread votes on the DP group, and two threads must not
interleave collectives on one group. Split sizes and token counts always go over Gloo, so a
peer that died or stopped stepping makes the rank fail with MoECollectiveError -- naming
the rank, the layer and the timeout -- within the collective timeout, never a hang; the
rows themselves go over NCCL on CUDA, over the same Gloo group on the CPU. NCCL refuses two
ranks on one GPU, so ranks that share a GPU stage the rows through host memory over Gloo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer_dp.distributed.groups import DPGroups, all_gather_json
from deepinfer_dp.distributed.lockstep import LockstepError
from deepinfer_dp.layers.moe import FusedMoE

ALL2ALL_BACKENDS = ("all_to_all", "allgather_reducescatter")


class MoECollectiveError(LockstepError):
    """A MoE layer's collective failed: a peer died or stopped stepping. The engine's step
    in flight is lost; re-form the group on a fresh store."""


@dataclass
class EPGroup:
    rank: int
    size: int
    cpu_group: dist.ProcessGroup  # Gloo: split sizes and token counts (and the rows on the CPU)
    device_group: dist.ProcessGroup  # the rows: NCCL on CUDA, cpu_group on the CPU
    device: torch.device
    timeout_s: float
    origin: str
    stage_on_host: bool = False  # CUDA ranks sharing a GPU: rows go through host memory, over Gloo


def init_ep_group(groups: DPGroups) -> EPGroup:
    """The EP groups over the DP ranks; a collective call: every rank makes it, in order."""
    timeout = timedelta(seconds=groups.timeout_s)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    device_group, shared_gpu = cpu_group, False
    if groups.device.type == "cuda":
        gpus = all_gather_json(groups, str(torch.cuda.get_device_properties(groups.device).uuid))
        shared_gpu = len(set(gpus)) < len(gpus)
        if not shared_gpu:
            device_group = dist.new_group(backend="nccl", timeout=timeout)
    return EPGroup(groups.rank, groups.world_size, cpu_group, device_group, groups.device,
                   groups.timeout_s, groups.origin, shared_gpu)


def make_dispatcher(backend: str, ep: EPGroup, num_experts: int) -> Dispatcher:
    if backend == "all_to_all":
        return AllToAllDispatcher(ep, num_experts)
    if backend == "allgather_reducescatter":
        return AllGatherReduceScatterDispatcher(ep, num_experts)
    raise ValueError(f"unknown all2all_backend {backend!r}; choose from {', '.join(ALL2ALL_BACKENDS)}")


class Dispatcher:
    """Shared by every MoE layer of one model; one instance per EP group."""

    name = ""

    def __init__(self, ep: EPGroup, num_experts: int) -> None:
        self.ep = ep
        self.collective_s = 0.0  # wall time in this dispatcher's collectives, waiting included
        self.num_collectives = 0
        self.broken: MoECollectiveError | None = None

    def begin_step(self, num_tokens: int) -> None:
        """Called once per forward pass, before the first MoE layer."""

    def dispatch_combine(self, layer: FusedMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         counted: bool) -> torch.Tensor:
        raise NotImplementedError

    def collective(self, what: str, layer_index: int | None, fn):
        """Runs one collective; turns a failure into MoECollectiveError (and every later call
        on this broken group fails at once instead of waiting out the timeout again). The
        load balancer's collectives (eplb/rebalancer.py) go through here too."""
        if self.broken is not None:
            raise self.broken
        start = time.perf_counter()
        try:
            return fn()
        except (RuntimeError, dist.DistError) as e:
            self.broken = self._error(what, layer_index, time.perf_counter() - start, e)
            raise self.broken from e
        finally:
            self.collective_s += time.perf_counter() - start
            self.num_collectives += 1

    def _error(self, what: str, layer_index: int | None, waited_s: float, cause: Exception) -> MoECollectiveError:
        ep = self.ep
        peers = [r for r in range(ep.size) if r != ep.rank]
        where = f"layer {layer_index}" if layer_index is not None else "the start of the step"
        first = str(cause).splitlines()[0] if str(cause) else repr(cause)
        return MoECollectiveError(
            f"DP rank {ep.rank} of {ep.size}: the MoE {what} of {where} (expert parallel, {self.name} "
            f"dispatcher, over the group from {ep.origin}) failed after {waited_s:.1f}s, collective timeout "
            f"{ep.timeout_s:.0f}s: peer rank(s) {peers} died or stopped stepping (a rank without work must "
            f"still run placeholder steps). The step in flight is lost and the group cannot be reused; "
            f"re-form it on a fresh store. Cause: {first}")

    # ---- the rows on the wire: hidden state, then each slot's expert id and weight, then
    # whether the token counts in the expert load (not the placeholder's dummy token)
    def _pack(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counted: bool) -> torch.Tensor:
        flag = torch.full((x.shape[0], 1), float(counted), dtype=torch.float32, device=x.device)
        return self.to_wire(torch.cat([x.float(), ids.float(), weights.float(), flag], dim=1))

    def _unpack(self, rows: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype):
        rows = self.from_wire(rows)
        h = rows[:, :hidden] if dtype == torch.float32 else rows[:, :hidden].to(dtype)
        ids = rows[:, hidden:hidden + top_k].to(torch.int32)
        weights = rows[:, hidden + top_k:hidden + 2 * top_k].contiguous()
        return h, ids, weights, rows[:, -1] > 0.5

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.ep.stage_on_host else t

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.ep.device) if self.ep.stage_on_host else t


class AllToAllDispatcher(Dispatcher):
    name = "all_to_all"

    def dispatch_combine(self, layer: FusedMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         counted: bool) -> torch.Tensor:
        ep, index = self.ep, layer.layer_index
        need = torch.zeros(x.shape[0], ep.size, dtype=torch.bool, device=x.device)
        need.scatter_(1, layer.slot_owner(x.device)[ids.long()], True)  # token t has an expert on rank r
        dest, token = need.t().nonzero(as_tuple=True)  # grouped by destination rank, tokens in order
        send = torch.bincount(dest, minlength=ep.size).cpu()
        recv = torch.empty_like(send)
        self.collective("split-size exchange", index,
                         lambda: dist.all_to_all_single(recv, send, group=ep.cpu_group))
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        rows = self._pack(x[token], ids[token], weights[token], counted)
        got = rows.new_empty(sum(recv_sizes), rows.shape[1])
        self.collective("all-to-all dispatch", index, lambda: dist.all_to_all_single(
            got, rows, recv_sizes, send_sizes, group=ep.device_group))
        h, rids, rweights, rcounted = self._unpack(got, x.shape[1], ids.shape[1], x.dtype)
        partial = self.to_wire(layer.compute(h, rids, rweights, rcounted))
        back = partial.new_empty(rows.shape[0], x.shape[1])
        self.collective("all-to-all combine", index, lambda: dist.all_to_all_single(
            back, partial, send_sizes, recv_sizes, group=ep.device_group))
        back = self.from_wire(back)
        out = torch.zeros_like(x)
        start = 0
        for size in send_sizes:  # rank by rank: a token's shares are summed in rank order
            if size:
                out.index_add_(0, token[start:start + size], back[start:start + size])
            start += size
        return out


class AllGatherReduceScatterDispatcher(Dispatcher):
    name = "allgather_reducescatter"

    def __init__(self, ep: EPGroup, num_experts: int) -> None:
        super().__init__(ep, num_experts)
        self.max_tokens = 0

    def begin_step(self, num_tokens: int) -> None:
        """Every rank's token count is the same for all layers of a step: gathered once."""
        mine = torch.tensor([num_tokens], dtype=torch.int64)
        counts = torch.empty(self.ep.size, dtype=torch.int64)
        self.collective("token-count exchange", None,
                         lambda: dist.all_gather_single(counts, mine, group=self.ep.cpu_group))
        self.max_tokens = int(counts.max())

    def dispatch_combine(self, layer: FusedMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         counted: bool) -> torch.Tensor:
        ep, index, width = self.ep, layer.layer_index, self.max_tokens
        rows = self._pack(x, ids, weights, counted)
        if rows.shape[0] < width:  # padding rows: no expert anywhere (-1), not counted
            pad = rows.new_zeros(width - rows.shape[0], rows.shape[1])
            pad[:, x.shape[1]:x.shape[1] + ids.shape[1]] = -1
            rows = torch.cat([rows, pad])
        everyone = rows.new_empty(ep.size * width, rows.shape[1])
        self.collective("all-gather dispatch", index,
                         lambda: dist.all_gather_single(everyone, rows, group=ep.device_group))
        partial = self.to_wire(layer.compute(*self._unpack(everyone, x.shape[1], ids.shape[1], x.dtype)))
        mine = partial.new_empty(width, x.shape[1])
        self.collective("reduce-scatter combine", index, lambda: dist.reduce_scatter_single(
            mine, partial.contiguous(), op=dist.ReduceOp.SUM, group=ep.device_group))
        return self.from_wire(mine[:x.shape[0]])
