"""Logical and physical experts of one MoE layer under expert-parallel load balancing.

The router picks logical experts; the layer holds physical slots, num_experts + redundant of
them, slots_per_rank on each rank (rank r owns slots [r*S, (r+1)*S)). Every logical expert
has at least one slot, a hot one several (replicas holding the same weights). A token-slot's
replica is chosen by (token index + slot) mod the expert's replica count: the choice
spreads an expert's tokens over its replicas and never changes what is computed, since every
replica holds the same weights.

The map also counts, per step, the token-slots of real tokens this rank routed to each
logical expert and to each rank: the balancer's input (eplb/rebalancer.py). The counts stay
on the device (no sync per layer); the balancer reads them.
"""

from __future__ import annotations

import numpy as np
import torch


def initial_placement(num_experts: int, num_slots: int) -> np.ndarray:
    """Slot p holds logical expert p mod num_experts: the first `redundant` experts twice."""
    return np.arange(num_slots, dtype=np.int64) % num_experts


def check_layout(num_experts: int, redundant: int, ranks: int) -> int:
    """Slots per rank; ValueError naming the numbers when they do not divide evenly."""
    slots = num_experts + redundant
    if slots % ranks:
        raise ValueError(f"eplb_config.num_redundant_experts={redundant}: {num_experts} experts + {redundant} "
                         f"redundant = {slots} physical slots per MoE layer do not divide evenly over {ranks} "
                         f"expert-parallel ranks (every rank holds the same number of slots; "
                         f"{fit_redundant(num_experts, redundant, ranks)} would)")
    return slots // ranks


def fit_redundant(num_experts: int, redundant: int, ranks: int) -> int:
    """The redundant slot count nearest `redundant` (the smaller on a tie) that divides evenly
    over `ranks`: what a group re-formed at another size uses."""
    fits = [r for r in range(redundant + ranks) if (num_experts + r) % ranks == 0]
    return min(fits, key=lambda r: (abs(r - redundant), r))


class ExpertMap:
    def __init__(self, phys_to_log: np.ndarray, num_experts: int, num_ranks: int, device: torch.device) -> None:
        self.num_experts = num_experts
        self.num_slots = len(phys_to_log)
        self.num_ranks = num_ranks
        self.slots_per_rank = self.num_slots // num_ranks
        self.device = device
        # token-slots this rank routed since the balancer last read them: per logical expert,
        # then per rank (the load each rank computes for this rank's tokens)
        self.counts = torch.zeros(num_experts + num_ranks, dtype=torch.int64, device=device)
        self.set(phys_to_log)

    def set(self, phys_to_log: np.ndarray) -> None:
        """Switches to a new placement (the weights must already be where it says)."""
        phys_to_log = np.asarray(phys_to_log, dtype=np.int64)
        replicas = np.bincount(phys_to_log, minlength=self.num_experts)
        if len(phys_to_log) != self.num_slots or replicas.min() < 1:
            raise ValueError(f"a placement must give each of {self.num_experts} experts a slot among "
                             f"{self.num_slots}: {phys_to_log.tolist()}")
        table = np.full((self.num_experts, int(replicas.max())), -1, dtype=np.int64)
        for e in range(self.num_experts):
            table[e, :replicas[e]] = np.flatnonzero(phys_to_log == e)
        self.phys_to_log = phys_to_log
        self._replicas = torch.from_numpy(replicas).to(self.device)
        self._table = torch.from_numpy(table).to(self.device)
        self._owner = torch.arange(self.num_slots, device=self.device) // self.slots_per_rank

    def is_initial(self) -> bool:
        return bool(np.array_equal(self.phys_to_log, initial_placement(self.num_experts, self.num_slots)))

    def local_logical(self, rank: int) -> list[int]:
        """The logical expert of each of rank `rank`'s slots, in slot order."""
        s = self.slots_per_rank
        return self.phys_to_log[rank * s:(rank + 1) * s].tolist()

    def to_physical(self, ids: torch.Tensor, counted: bool) -> torch.Tensor:
        """Logical ids int32 [T, k] -> physical slots int32 [T, k]; counts them if `counted`."""
        num_tokens, top_k = ids.shape
        logical = ids.long()
        order = (torch.arange(num_tokens, device=ids.device)[:, None]
                 + torch.arange(top_k, device=ids.device)[None, :])  # consecutive tokens alternate
        physical = self._table[logical, order % self._replicas[logical]]
        if counted and num_tokens:
            self.counts[:self.num_experts] += torch.bincount(logical.view(-1), minlength=self.num_experts)
            self.counts[self.num_experts:] += torch.bincount(self._owner[physical.view(-1)],
                                                             minlength=self.num_ranks)
        return physical.to(torch.int32)

    def take_counts(self) -> torch.Tensor:
        """The counts since the last call (a copy), reset to zero."""
        taken = self.counts.clone()
        self.counts.zero_()
        return taken
