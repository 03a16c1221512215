"""Data-parallel process groups and the lockstep vote (docs/architecture.md, "Lockstep")."""

from deepinfer_dp.distributed.groups import (
    DPGroups,
    destroy_dp_groups,
    init_dp_groups,
    init_dp_groups_from_env,
    torchrun_env,
)
from deepinfer_dp.distributed.lockstep import Lockstep, LockstepError, RegroupRequested

__all__ = ["DPGroups", "Lockstep", "LockstepError", "RegroupRequested", "destroy_dp_groups", "init_dp_groups",
           "init_dp_groups_from_env", "torchrun_env"]
