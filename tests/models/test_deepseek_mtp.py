"""MTP drafting with DeepSeek-V3's next-n layer, on a tiny V3 whose checkpoint stores a random
next-n layer the way DeepSeek does (model.layers.<num_hidden_layers>.*): the MTP forward
through our paged latent cache (a prefill pass, then decode steps) matches a straightforward
PyTorch reference within 1e-4; greedy output with MTP (K = 1 and 3) is token-identical to
without on 16 prompts, with acceptance reported per draft position; the drafts themselves are
the reference's chain from the target's hidden state; under expert parallelism the layer holds
and loads only its rank's routed experts; bad setups are refused by name."""

from __future__ import annotations

import pytest
import torch
from deepseek_utils import build_tiny_deepseek
from model_utils import build_metadata
from moe_utils import load_oracle, random_prompts
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.layers.mla import allocate_mla_cache
from deepinfer_dp.models import load_model
from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return build_tiny_deepseek("v3", tmp_path_factory.mktemp("mtp") / "v3-nextn", with_nextn=True)


# ---- the reference ------------------------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(model_dir, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, vocab], block output [T, H]) of the next-n layer over one sequence from
    position 0: embedding (zeroed at position 0), enorm/hnorm, eh_proj, the decoder block as
    transformers defines it (eager, causal), shared_head.norm, the main lm_head."""
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    w = load_file(model_dir / "model.safetensors")
    n, eps = config.num_hidden_layers, config.rms_norm_eps
    pre = f"model.layers.{n}."
    positions = torch.arange(tokens.shape[0])
    embeds = w["model.embed_tokens.weight"][tokens]
    embeds[positions == 0] = 0
    x = torch.cat([_rms(embeds, w[pre + "enorm.weight"], eps), _rms(hidden, w[pre + "hnorm.weight"], eps)], -1)
    x = x @ w[pre + "eh_proj.weight"].T
    block = DeepseekV3DecoderLayer(config, n).eval()
    state = {k[len(pre):]: v for k, v in w.items() if k.startswith(pre)}
    num = config.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                state.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                     for e in range(num)])
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(num)])
    extra = {k: state.pop(k) for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")}
    block.load_state_dict(state)
    cos, sin = DeepseekV3RotaryEmbedding(config)(x[None], positions[None])
    length = tokens.shape[0]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = block(x[None], attention_mask=mask, position_ids=positions[None], position_embeddings=(cos, sin))[0]
    logits = _rms(out, extra["shared_head.norm.weight"], eps) @ w["lm_head.weight"].T
    return logits, out


# ---- the MTP forward in isolation -----------------------------------------------------------
def test_mtp_forward_matches_reference(mtp_dir):
    """A 21-token prefill pass through the paged cache, then 3 decode steps reading it back."""
    loaded = load_model(str(mtp_dir), torch.float32, "cpu", mtp=True)
    mtp, config = loaded.mtp, loaded.hf_config
    cache = allocate_mla_cache(config, 16, 4, torch.float32, "cpu")[0]
    mtp.bind_kv_cache(cache)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, config.vocab_size, (24,), generator=gen)
    hidden = torch.randn(24, config.hidden_size, generator=gen)
    ref_logits, _ = reference_mtp_logits(mtp_dir, tokens, hidden)
    table = [[5, 2, 9, 11, 3, 7]]
    with torch.inference_mode():
        md = build_metadata([21], [21], table, 4, True)
        ours = [mtp.compute_logits(mtp(tokens[:21], torch.arange(21), md, hidden[:21]))]
        for t in range(21, 24):
            md = build_metadata([1], [t + 1], table, 4, False)
            ours.append(mtp.compute_logits(mtp(tokens[t:t + 1], torch.tensor([t]), md, hidden[t:t + 1])))
    diff = (torch.cat(ours) - ref_logits).abs().max().item()
    assert diff < 1e-4, f"max |logit difference| {diff:.2e}"


def test_mtp_layer_holds_its_expert_parallel_share(mtp_dir):
    """Under EP (rank 1 of 2) the MTP layer allocates and loads only its experts 4-7, the full
    layer's tensors; rebinding the target to a group of one (re-formed) reloads all 8."""
    full = load_model(str(mtp_dir), torch.float32, "cpu", mtp=True).mtp.experts
    loaded = load_model(str(mtp_dir), torch.float32, "cpu", expert_shard=(1, 2), mtp=True)
    target, mtp = loaded.model, loaded.mtp
    moe = mtp.experts
    assert (moe.first_expert, moe.end_expert) == (4, 8) and moe.w13.shape[0] == moe.w2.shape[0] == 4
    assert torch.equal(moe.w13, full.w13[4:]) and torch.equal(moe.w2, full.w2[4:])
    assert target.nextn == (mtp,)
    assert load_model(str(mtp_dir), torch.float32, "cpu").mtp is None  # only when asked for
    target.bind_ep_group(None, "all_to_all")
    moe = mtp.experts
    assert (moe.first_expert, moe.end_expert) == (0, 8) and moe.dispatcher is None
    assert torch.equal(moe.w13, full.w13) and torch.equal(moe.w2, full.w2)


# ---- through the engine -------------------------------------------------------------------
def _generate(path, prompts, spec, max_tokens=12):
    llm = LLM(str(path), decode_sequence=False, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=256,
              block_size=4, speculative_config=spec)
    try:
        out = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
        stats = llm.rank_stats()[0]
    finally:
        llm.shutdown()
    return [[t for o in outs for t in o.token_ids] for outs in out], stats


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_mtp_equals_without(mtp_dir, k):
    lengths = [1, 3, 90, 5, 17, 2, 64, 8, 33, 4, 45, 11, 6, 27, 70, 9]
    prompts = random_prompts(400, lengths, seed=7)
    off, _ = _generate(mtp_dir, prompts, None)
    on, stats = _generate(mtp_dir, prompts, {"method": "mtp", "num_speculative_tokens": k,
                                             "disable_by_batch_size": None})
    assert on == off
    assert stats["spec_decode_num_drafts"] > 0
    assert len(stats["spec_decode_acceptance_rate_per_pos"]) == k  # MTP acceptance by draft position


def test_drafts_are_the_reference_chain(mtp_dir):
    """One sequence, K = 2: each drafting round's drafts equal the reference next-n chain run
    from transformers' hidden state at position L - 2 and the newest token."""
    from deepinfer_dp.spec_decode import mtp as mtp_module

    recorded = []
    original = mtp_module.MTPProposer._draft

    def spy(self, lens, lasts, tables, k, states, *rest):
        drafts, probs = original(self, lens, lasts, tables, k, states, *rest)
        recorded.append((lens[0], drafts[0].tolist()))
        return drafts, probs

    mtp_module.MTPProposer._draft = spy
    try:
        prompt = random_prompts(400, [13], seed=3)
        (output,), _ = _generate(mtp_dir, prompt, {"method": "mtp", "num_speculative_tokens": 2,
                                                   "disable_by_batch_size": None}, max_tokens=10)
    finally:
        mtp_module.MTPProposer._draft = original
    assert recorded
    hf = load_oracle(mtp_dir)  # our target's hidden states match transformers' (test_deepseek_models)
    sequence = prompt[0] + output
    with torch.inference_mode():
        target_hidden = hf.model(torch.tensor([sequence])).last_hidden_state[0]
    for length, drafts in recorded:
        tokens, hidden = torch.tensor(sequence[:length]), target_hidden[:length].clone()
        chain = []
        for _ in drafts:  # the reference chain (shorter near max_tokens): shift tokens, feed the block's output back
            logits, out = reference_mtp_logits(mtp_dir, tokens[1:], hidden[:-1])
            chain.append(int(logits[-1].argmax()))
            tokens = torch.cat([tokens, torch.tensor([chain[-1]])])
            hidden = torch.cat([hidden[:-1], out[-1:], hidden[-1:]])
        assert drafts == chain, f"at length {length}"


def test_mtp_refused_without_next_n_layer(tmp_path):
    path = build_tiny_deepseek("v3", tmp_path / "v3")
    with pytest.raises(ValueError, match=r"next-n layer \(model\.layers\.3\.\*\) is missing"):
        LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
