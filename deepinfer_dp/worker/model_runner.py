"""Turns a scheduler batch into model inputs on the device, runs the forward pass and
returns the logits of the rows that sample. Owns the paged KV cache."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from deepinfer_dp import _C
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.layers.attention import AttentionMetadata, attention_layers
from deepinfer_dp.layers.cpu_threads import narrow_step
from deepinfer_dp.layers.kv_groups import KvGroups, plan_kv_groups
from deepinfer_dp.layers.linear import replace_linears
from deepinfer_dp.models import LoadedModel, allocate_kv_cache, kv_cache_bytes_per_block, num_layers
from deepinfer_dp.multimodal.step_inputs import MultiModalStep
from deepinfer_dp.spec_decode.proposer import TargetStep
from deepinfer_dp.utils.cpu_malloc import keep_freed_memory
from deepinfer_dp.worker import prompt_logprobs

# The scheduler's batch arrays are read-only views (it reads them back when it processes the
# batch); the tensors over them are only read, so torch's one-time notice about it is noise.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
# Test-only switch: "1" skips the placeholder step's forward pass, to show why it is there
# (with expert parallelism the busy ranks' MoE collectives then wait for this rank in vain).
SKIP_PLACEHOLDER_FORWARD = os.environ.get("DEEPINFER_DP_TEST_SKIP_PLACEHOLDER_FORWARD") == "1"


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor | None  # int64 [N]; None for the placeholder step
    inflight_src: torch.Tensor | None = None  # int64 [T]: previous step's sample row, or -1
    prev_tokens: torch.Tensor | None = None  # the previous step's sampled ids (on the device)
    # Prefill rows whose logits requests want as prompt logprobs; forward() fills its result.
    prompt_logprobs: prompt_logprobs.PromptLogprobsSpec | None = None
    # Shown this forward on the device (a speculative proposer's network; Speculator.observer_for).
    observer: Callable[[TargetStep], None] | None = None
    # Image rows of this step (a vision-language model's prompt chunks): spliced into the embeddings.
    mm: MultiModalStep | None = None


def kv_cache_dtype_for(config: EngineConfig, hf_config) -> torch.dtype:
    """The KV cache's element type: the compute dtype, or (kv_cache_dtype="bfloat16") bf16 under
    fp32 compute on the CPU, where the kernels widen it exactly as they read it. Any other
    mix is refused by name rather than run on a path that was never built for it."""
    cache, compute = config.kv_cache_torch_dtype(), config.torch_dtype()
    if cache == compute:
        return cache
    from deepinfer_dp.layers.mla import is_mla

    if cache != torch.bfloat16 or compute != torch.float32 or config.torch_device().type != "cpu":
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype} with dtype={compute} on "
                         f"{config.torch_device().type} is not supported: a cache type other than the compute "
                         "dtype's is bfloat16 under float32 on the CPU only (or use kv_cache_dtype=auto)")
    if is_mla(hf_config):
        raise ValueError("kv_cache_dtype=bfloat16 is not supported for MLA models (DeepSeek's latent cache): "
                         "use kv_cache_dtype=auto")
    return cache


def num_kv_blocks_for(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, max_model_len: int,
                      draft_bytes_per_block: int = 0) -> int:
    """Blocks in the KV cache: as configured, or as many as kv_cache_memory_gb holds, but no
    more than max_num_seqs full-length sequences can use (plus the dummy block 0).

    `draft_bytes_per_block`: a block of a speculative proposer's own cache (a draft model's),
    which has one block per target block plus max_num_seqs scratch blocks: the budget holds
    both caches, as vLLM's KV memory does, so the target gets fewer blocks."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    groups = kv_groups(config, loaded)
    per_block = kv_block_bytes(config, loaded, dtype)
    useful = config.max_num_seqs * -(-max_model_len // config.block_size) * groups.num_groups + 1
    budget = int(config.kv_cache_memory_gb * 2**30) - config.max_num_seqs * draft_bytes_per_block
    return max(2, min(budget // (per_block + draft_bytes_per_block), useful))


def kv_groups(config: EngineConfig, loaded: LoadedModel) -> KvGroups:
    """How the model's layers share the KV cache (layers/kv_groups.py): the scheduler frees
    the sliding groups' blocks as they leave the window. One group that keeps every block
    under speculative decoding: a proposer with its own cache (a draft model, MTP) reads the
    target's whole block table."""
    windows = [a.window for a in attention_layers(loaded.model)]
    if config.speculative_config is not None:
        windows = [0] * len(windows)
    return plan_kv_groups(windows, hybrid=not config.disable_hybrid_kv_cache_manager)


def kv_block_bytes(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype) -> int:
    """Bytes of one scheduler block: every layer's, or with KV groups one group's layers'."""
    per_block = kv_cache_bytes_per_block(loaded.hf_config, config.block_size, dtype)
    groups = kv_groups(config, loaded)
    return per_block // num_layers(loaded.hf_config) * groups.group_size if groups.grouped else per_block


def kv_cache_bytes(config: EngineConfig, per_block: int, num_blocks: int, draft_bytes_per_block: int = 0) -> int:
    """Memory of the KV cache of `num_blocks` blocks, a proposer's own cache included."""
    return num_blocks * per_block + (num_blocks + config.max_num_seqs) * draft_bytes_per_block


def check_kv_capacity(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, num_blocks: int,
                      max_model_len: int, draft_bytes_per_block: int = 0) -> None:
    """Refuses at start-up (as vLLM does) a KV cache that cannot hold one sequence of
    max_model_len tokens: a request allowed to grow that long could never be served."""
    usable = num_blocks - 1  # block 0 is the placeholder step's
    groups = kv_groups(config, loaded).num_groups  # a sequence holds a block of each group
    holds = usable // groups * config.block_size
    if holds >= max_model_len:
        return
    need = -(-max_model_len // config.block_size) * groups + 1
    per_block = kv_block_bytes(config, loaded, dtype)
    gb = math.ceil(kv_cache_bytes(config, per_block, need, draft_bytes_per_block) / 2**30 * 1000) / 1000
    by_memory = f"--kv-cache-memory-gb {gb:g} (kv_cache_memory_gb)"
    by_blocks = f"--num-kv-blocks {need} (num_kv_blocks)"
    if config.num_kv_blocks is not None:  # it wins over the memory budget
        source, more = f"num_kv_blocks={config.num_kv_blocks}", f"{by_blocks}, or drop it and set {by_memory}"
    else:
        source, more = f"kv_cache_memory_gb={config.kv_cache_memory_gb}", f"{by_memory} or {by_blocks}"
    blocks = f"{usable} blocks of {config.block_size} from {source}, block 0 reserved" + (
        f"; a sequence holds a block of each of the model's {groups} KV groups" if groups > 1 else "")
    raise ValueError(
        f"the KV cache holds {holds} tokens ({blocks}) but max_model_len is {max_model_len}, "
        f"so one sequence of max_model_len tokens cannot fit. "
        f"Use a smaller --max-model-len (max_model_len, at most {holds}), or give the KV cache more memory: {more}")


def check_kv_memory(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, num_blocks: int) -> None:
    """Refuses at start-up a CPU KV cache larger than the memory the machine has available: the
    cache is made resident when it is allocated, so the OOM killer would end the process instead."""
    if config.torch_device().type != "cpu":
        return
    need = kv_cache_bytes(config, kv_block_bytes(config, loaded, dtype), num_blocks)
    available = psutil.virtual_memory().available
    if need <= available:
        return
    source = (f"num_kv_blocks={config.num_kv_blocks}" if config.num_kv_blocks is not None
              else f"kv_cache_memory_gb={config.kv_cache_memory_gb}")
    raise ValueError(
        f"the KV cache needs {need / 2**30:.2f} GiB ({num_blocks} blocks from {source}) but this machine has "
        f"{available / 2**30:.2f} GiB of memory available: give it less with --kv-cache-memory-gb "
        f"(kv_cache_memory_gb) or --num-kv-blocks (num_kv_blocks)")


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_blocks: int) -> None:
        self.model = loaded.model
        self.device = config.torch_device()
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.vocab_size = loaded.hf_config.vocab_size
        self.cpu_threads = torch.get_num_threads()  # as the engine set it
        self.batch_invariant = config.batch_invariant
        if self.device.type == "cpu":
            keep_freed_memory()
        if self.device.type == "cpu" and next(self.model.parameters()).dtype == torch.float32 \
                and config.cpu_linear_kernel:
            replace_linears(self.model)
        cache_dtype = kv_cache_dtype_for(config, loaded.hf_config)
        self.kv_groups = kv_groups(config, loaded)  # the scheduler's groups and window
        check_kv_memory(config, loaded, cache_dtype, num_blocks)
        self.kv_caches = self._allocate_kv_cache(loaded, num_blocks, config.block_size, cache_dtype)
        self.model.bind_kv_cache(self.kv_caches)
        for attn, group in zip(attention_layers(self.model), self.kv_groups.layer_group, strict=True):
            attn.kv_group = group
        # Tokens of the placeholder step: 1, or 1 + K under speculative decoding (draft
        # padding), so that its shapes match a speculative step's.
        spec = config.speculative_config
        self.placeholder_tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self.forward_time_s = 0.0  # host time in forward() (CPU: the whole pass; CUDA: the launches)

    @property
    def decode_stack_steps(self) -> int:
        """Steps the one-call C++ decode stack ran (models/llama_cpu_decode.py); 0 for a model
        that steps through its modules."""
        stack = getattr(self.model, "cpu_decode", None)
        return stack.steps if stack else 0

    def _allocate_kv_cache(self, loaded: LoadedModel, num_blocks: int, block_size: int, dtype: torch.dtype) -> list:
        """Per layer its cache; with KV groups, layer j of every group shares tensor j."""
        groups = self.kv_groups
        if not groups.grouped:
            return allocate_kv_cache(loaded.hf_config, num_blocks, block_size, dtype, self.device)
        slots = allocate_kv_cache(loaded.hf_config, num_blocks, block_size, dtype, self.device, groups.group_size)
        return [slots[j] for j in groups.layer_slot]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        # Zero-copy over the scheduler's buffer on CPU; one host-to-device copy on CUDA.
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def prepare(self, out: _C.SchedulerOutput) -> ModelInput:
        inflight_src = self._tensor(out.input_from_prev) if out.has_inflight_inputs else None
        qsl = out.query_start_loc
        seq_lens = out.seq_lens
        query_lens = np.diff(qsl)
        md = AttentionMetadata(
            # several query tokens per sequence (a decode step with drafts) take the prefill
            # path, which attends causally over cached context
            is_prefill=out.is_prompt or int(query_lens.max()) > 1,
            slot_mapping=self._tensor(out.slot_mapping),
            block_tables=self._tensor(out.block_tables),
            query_start_loc=self._tensor(qsl),
            seq_lens=self._tensor(seq_lens),
            query_lens_host=query_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_kv_groups=out.num_kv_groups,
        )
        return ModelInput(self._tensor(out.input_ids), self._tensor(out.positions), md,
                          self._tensor(out.sample_indices), inflight_src)

    def placeholder_input(self) -> ModelInput:
        """Dummy tokens at positions 0.. in the reserved block 0 (one, or 1 + K with draft
        padding): the same forward pass as a real step, so collectives inside the model
        match across DP ranks."""
        n, groups = self.placeholder_tokens, self.kv_groups.num_groups
        pos = torch.arange(n, dtype=torch.int64, device=self.device)
        md = AttentionMetadata(
            is_prefill=True,
            slot_mapping=pos.repeat_interleave(groups),
            block_tables=torch.zeros((1, groups), dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.full((1,), n, dtype=torch.int32, device=self.device),
            query_lens_host=[n],
            seq_lens_host=[n],
            max_query_len=n,
            max_seq_len=n,
            is_placeholder=True,
            num_kv_groups=groups,
        )
        return ModelInput(torch.zeros(n, dtype=torch.int64, device=self.device), pos, md, None)

    def forward(self, inp: ModelInput) -> torch.Tensor | None:
        """Logits [N, vocab] (fp32) of the sampling rows; None for the placeholder step."""
        start = time.perf_counter()
        try:
            return self._forward(inp)
        finally:
            self.forward_time_s += time.perf_counter() - start

    @torch.inference_mode()
    def _forward(self, inp: ModelInput) -> torch.Tensor | None:
        if inp.attn_metadata.is_placeholder and SKIP_PLACEHOLDER_FORWARD:
            return None
        input_ids = inp.input_ids
        if inp.inflight_src is not None:
            # Tokens the previous (deferred) step sampled, never read on the host yet.
            src = inp.inflight_src.long()
            input_ids = torch.where(src >= 0, inp.prev_tokens[src.clamp(min=0)], input_ids)
        with self.thread_plan(input_ids.numel()):
            if inp.mm is None:
                hidden = self.model(input_ids, inp.positions, inp.attn_metadata)
            else:  # the vision encoder runs here, inside the step, for images not in its cache
                embeds = inp.mm.embeddings(self.model, input_ids, self.vocab_size)
                hidden = self.model(input_ids, inp.mm.positions(inp.positions), inp.attn_metadata, inputs_embeds=embeds)
            if inp.observer is not None:
                inp.observer(TargetStep(input_ids, inp.positions, inp.attn_metadata, hidden, inp.sample_indices))
            if inp.prompt_logprobs is not None:
                prompt_logprobs.compute(self.model.compute_logits, hidden, inp.prompt_logprobs)
            if inp.sample_indices is None or inp.sample_indices.numel() == 0:
                return None
            return self.model.compute_logits(hidden[inp.sample_indices])

    def thread_plan(self, num_tokens: int):
        """The CPU thread plan of a pass over `num_tokens` tokens (cpu_threads.narrow_step): a
        proposer's own passes between steps run under it too."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        return narrow_step(self.cpu_threads, num_tokens, self.batch_invariant)
