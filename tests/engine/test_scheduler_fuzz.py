"""Property-based fuzz of the C++ scheduler through the binding (a hypothesis state machine).

Each episode draws a small configuration (1-11 usable blocks of 4, 8 or 16 tokens, prefix
caching on or off, a chunked-prefill budget of 1-48 tokens, 1-4 sequences, a context of
2-96, no sliding window or one of 3-20 positions whose blocks are freed as sequences leave
them, one KV group or two or three of which one or two keep every block), then a random
sequence of add / step (ZOS on or off, per step) / abort / finish_request / release / flush /
clone; the harness (scheduler_harness.py) checks every
invariant after each operation, and at the end drains the scheduler and checks that every
request ended once, with the right reason, and that every block came back.

The default run is deterministic (derandomized) and takes a few seconds; `-m slow` runs
3,000 episodes (tools/sanitizer_build.sh runs it under ASan/UBSan).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from scheduler_harness import SchedulerHarness

from deepinfer_dp import _C

STATUSES = [_C.SequenceStatus.FINISHED_ABORTED, _C.SequenceStatus.FINISHED_STOPPED,
            _C.SequenceStatus.FINISHED_LENGTH]


class Counts:
    episodes = 0
    operations = 0


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([4, 8, 16]), num_blocks=st.integers(2, 12),
                max_model_len=st.integers(2, 96), budget=st.integers(1, 48), max_num_seqs=st.integers(1, 4),
                prefix_caching=st.booleans(), vocab=st.integers(6, 24), salt=st.integers(0, 1000),
                zos=st.booleans(), window=st.sampled_from([0, 0, 3, 8, 20]),
                groups=st.sampled_from([(1, 0), (1, 0), (2, 1), (3, 1), (3, 2)]))
    def setup(self, block_size, num_blocks, max_model_len, budget, max_num_seqs, prefix_caching, vocab, salt,
              zos, window, groups):
        cfg = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
                   num_blocks=max(num_blocks, groups[0] + 1), max_model_len=max_model_len, vocab_size=vocab,
                   enable_prefix_caching=prefix_caching, sliding_window=window, num_kv_groups=groups[0],
                   num_full_kv_groups=groups[1])
        self.h = SchedulerHarness(cfg, salt)
        self.zos = zos  # the drain's mode; each step draws its own
        # Prompts are cut from two shared streams, so whole blocks repeat across requests.
        self.shared = [[(salt + f * 7 + i * (f + 2)) % vocab for i in range(64)] for f in range(2)]
        Counts.episodes += 1

    @rule(family=st.integers(0, 1), prefix_blocks=st.integers(0, 2), tail=st.lists(st.integers(0, 63), max_size=12),
          max_tokens=st.integers(1, 24), min_tokens=st.integers(0, 3), eos=st.integers(-1, 23),
          stop_ids=st.lists(st.integers(0, 23), max_size=2), ignore_eos=st.booleans())
    def add(self, family, prefix_blocks, tail, max_tokens, min_tokens, eos, stop_ids, ignore_eos):
        vocab = self.h.vocab
        prompt = self.shared[family][: prefix_blocks * self.h.bs] + [t % vocab for t in tail]
        self.h.add(prompt or [0], max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                   eos_token_id=eos if eos < vocab else -1, stop_token_ids=[s % vocab for s in stop_ids],
                   ignore_eos=ignore_eos)

    @rule(zos=st.booleans(), count=st.integers(1, 4))
    def step(self, zos, count):
        for _ in range(count):
            self.h.step(zos)
            self.h.check_invariants()

    @rule(index=st.integers(0, 15), status=st.sampled_from(STATUSES))
    def finish(self, index, status):
        """abort / finish_request a live request, or (index past the live ones) an unknown or
        finished id: then nothing changes and None comes back."""
        live = self.h.live_ids()
        rid = live[index] if index < len(live) else ("nope", "r0", "r3")[index % 3]
        self.h.finish(rid, status)

    @rule(op=st.sampled_from(["release", "flush", "clone"]), index=st.integers(0, 15))
    def host(self, op, index):
        """What the engine does between steps: release the pooled outputs, flush the step ZOS
        kept in flight, or clone an output to keep it."""
        if op == "release":
            self.h.release()
        elif op == "flush":
            self.h.flush()
        else:
            self.h.clone_one(index)

    @invariant()
    def holds(self):
        if hasattr(self, "h"):
            self.h.check_invariants()

    def teardown(self):
        if hasattr(self, "h"):
            self.h.drain(self.zos)
            Counts.operations += self.h.ops


def _run(episodes: int, steps: int) -> tuple[int, int]:
    Counts.episodes = Counts.operations = 0
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=episodes, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    print(f"scheduler fuzz: {Counts.episodes} episodes, {Counts.operations} operations")
    return Counts.episodes, Counts.operations


def test_scheduler_fuzz():
    episodes, operations = _run(episodes=300, steps=40)
    assert episodes >= 300 and operations >= 10 * episodes


@pytest.mark.slow
@pytest.mark.timeout(3600)  # minutes of CPU, several times that under the sanitizers
def test_scheduler_fuzz_long():
    episodes, operations = _run(episodes=3000, steps=50)
    assert episodes >= 3000 and operations >= 10 * episodes
