"""Offline DP under `torchrun --nproc-per-node N`: each process is one rank.

Each process builds LLM(...) as usual; LLM sees torchrun's environment and builds its
engine with a Lockstep on the DP group, so the step loop's vote is the MAX over all ranks
and every rank steps until the last one is done (a rank with an empty shard runs
placeholder steps). See launch/torchrun_generate.py.

The group is torn down deterministically: by LLM.shutdown(), or at interpreter exit when the
program did not call it. Nothing else holds the group (no reference cycle), so Gloo's threads
are gone before the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import dataclasses
import os

import torch

from deepinfer_dp.config import EngineConfig
from deepinfer_dp.distributed import DPGroups, destroy_dp_groups, init_dp_groups_from_env, torchrun_env
from deepinfer_dp.distributed.cpu_binding import bind_this_process, rank_cpus
from deepinfer_dp.distributed.groups import DEFAULT_TIMEOUT_S, all_gather_json
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.engine.step_loop import StepLoop


class TorchrunRank:
    """This process's place in the DP group, and the collective calls every rank makes."""

    def __init__(self, groups: DPGroups, loop: StepLoop) -> None:
        self.groups: DPGroups | None = groups
        self.loop = loop
        self.dp_rank = groups.rank
        self.dp_size = groups.world_size
        atexit.register(self.shutdown)

    def all_gather(self, obj) -> list:
        """Every rank's `obj` (JSON-encodable), in rank order. A collective: call it on every rank."""
        if self.groups is None:
            raise RuntimeError("the DP group was shut down")
        return all_gather_json(self.groups, obj)

    def rank_stats(self) -> list[dict]:
        """Every rank's counters, in rank order. A collective: call it on every rank."""
        return self.all_gather(self.loop.stats())

    def shutdown(self) -> None:
        """Stops the engine and destroys the group; safe to call twice."""
        atexit.unregister(self.shutdown)
        engine = self.loop.engine
        if engine.lockstep is not None:
            engine.lockstep.close()
        engine.shutdown()
        if self.groups is not None:
            self.groups = None
            destroy_dp_groups()


def build_torchrun_rank(config: EngineConfig) -> TorchrunRank:
    env = torchrun_env()
    assert env is not None, "build_torchrun_rank runs under torchrun only"
    rank, world = env
    if config.dp_size not in (1, world):
        raise ValueError(f"dp_size={config.dp_size} but torchrun started {world} processes; "
                         f"leave dp_size out under torchrun")
    device = config.device
    if device == "auto" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"torchrun local rank {local_rank} has no GPU of its own (this node has "
                             f"{torch.cuda.device_count()}); start at most that many processes per node, "
                             f"or choose a device for every rank with device='cuda:0' or 'cpu'")
        device = f"cuda:{local_rank}"
    config = dataclasses.replace(config, dp_size=world, dp_rank=rank, device=device)
    if config.torch_device().type == "cpu":
        local = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cpus = rank_cpus(*local)
        if cpus is not None:  # before the engine starts its device and OpenMP threads
            bind_this_process(cpus)
    timeout_s = float(os.environ.get("DEEPINFER_DP_COLLECTIVE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    engine = LLMEngine(config)
    groups = init_dp_groups_from_env(engine.device, timeout_s)
    engine.join_dp_group(groups)
    return TorchrunRank(groups, StepLoop(engine))
