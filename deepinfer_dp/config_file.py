"""YAML deployment configs: loaded, validated with pydantic, turned into EngineConfig.

A config names the model, the engine's limits, the DP layout and the server. An unknown
key, a wrong type or an impossible value stops with ONE ConfigError naming the file and the
key (e.g. `configs/x.yaml: router.policy: ...`). The CLI calls add_config_args(parser) and
load_config(args): `--config FILE` first, then any flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepinfer_dp.config import EngineConfig


class ConfigError(ValueError):
    """A deployment config that cannot run; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RouterSection(_Section):
    policy: Literal["round_robin", "least_loaded", "prefix_affinity"] = "round_robin"
    collective_timeout_s: float = Field(30.0, gt=0)


class RaySection(_Section):
    address: str = "local"  # "local": a private instance; "auto": the running cluster
    placement_strategy: Literal["pack", "spread"] = "pack"


class ServerSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None


class MetricsSection(_Section):
    port: int | None = Field(None, ge=0, le=65535)  # None: /metrics on the server's port only


class DeploymentConfig(_Section):
    model: str | None = None  # HF directory or .gguf; None: SmolLM2-135M-Instruct
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    dp_size: int = Field(1, ge=1)
    backend: Literal["ray", "torchrun"] = "ray"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    block_size: int = Field(16, ge=1)
    kv_cache_memory_gb: float = Field(1.0, gt=0)
    num_kv_blocks: int | None = Field(None, ge=2)
    max_model_len: int | None = Field(None, ge=2)
    zos: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    torch_threads: int | None = Field(None, ge=1)
    enable_expert_parallel: bool = False  # MoE models: split the routed experts over the DP ranks
    all2all_backend: Literal["all_to_all", "allgather_reducescatter"] = "all_to_all"
    router: RouterSection = RouterSection()
    ray: RaySection = RaySection()
    server: ServerSection = ServerSection()
    metrics: MetricsSection = MetricsSection()

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two")
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda") and not v.startswith("cuda:"):
            raise ValueError("must be auto, cpu or cuda[:N]")
        return v

    @model_validator(mode="after")
    def _fits_this_machine(self) -> DeploymentConfig:
        # A remote Ray cluster has its own devices; only a local deployment is checked here.
        if self.backend == "ray" and self.ray.address != "local":
            return self
        available, kind = _local_devices(self.device)
        if self.dp_size > available:
            raise ValueError(f"dp_size: {self.dp_size} ranks need more than the {available} {kind} "
                             f"available on this machine")
        return self

    def engine_config(self) -> EngineConfig:
        keys = ("model", "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "block_size",
                "num_kv_blocks", "kv_cache_memory_gb", "max_model_len", "enable_prefix_caching", "zos",
                "seed", "torch_threads", "dp_size", "enable_expert_parallel", "all2all_backend")
        return EngineConfig(**{k: getattr(self, k) for k in keys})

    def dp_options(self) -> dict[str, Any]:
        """Keywords for LLM(dp_options=...) / DPEngine when dp_size > 1 under Ray."""
        return {"policy": self.router.policy, "address": self.ray.address,
                "strategy": self.ray.placement_strategy,
                "collective_timeout_s": self.router.collective_timeout_s}


def _local_devices(device: str) -> tuple[int, str]:
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.device_count(), "GPUs"
    return os.cpu_count() or 1, "CPUs"


def parse_config(data: dict[str, Any], source: str = "<config>") -> DeploymentConfig:
    """Validates a dict; every problem is reported in one ConfigError naming `source`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: invalid config: " + "; ".join(map(_describe, e.errors()))) from None


def _describe(err: dict) -> str:
    """`key: what is wrong (got value)` for one pydantic error."""
    msg = err["msg"].removeprefix("Value error, ")
    key = ".".join(str(p) for p in err["loc"])
    if not key:  # a model-level check: its message starts with the key it means
        key, msg = (part.strip() for part in msg.split(":", 1))
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    value = err.get("input")
    got = "" if err["type"] == "missing" or isinstance(value, dict) or not err["loc"] else f" (got {value!r})"
    return f"{key}: {msg}{got}"


def load_config_file(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> DeploymentConfig:
    """Reads YAML at `path`, applies dotted-key overrides ("router.policy": ...), validates."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(_apply(data, overrides or {}), str(path))


def _apply(data: Any, overrides: dict[str, Any]) -> Any:
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[leaf] = value
    return data


# ---- the CLI hook ---------------------------------------------------------------------------
# flag dest -> dotted config key
_FLAGS: dict[str, str] = {
    "model": "model", "dtype": "dtype", "device": "device", "dp_size": "dp_size", "backend": "backend",
    "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size", "kv_cache_memory_gb": "kv_cache_memory_gb", "num_kv_blocks": "num_kv_blocks",
    "max_model_len": "max_model_len", "zos": "zos", "enable_prefix_caching": "enable_prefix_caching",
    "torch_threads": "torch_threads", "enable_expert_parallel": "enable_expert_parallel",
    "all2all_backend": "all2all_backend", "router_policy": "router.policy", "ray_address": "ray.address",
    "placement_strategy": "ray.placement_strategy", "host": "server.host", "port": "server.port",
    "api_key": "server.api_key", "metrics_port": "metrics.port",
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """--config FILE plus one flag per key; a flag given on the command line overrides the file.
    Every flag defaults to None (= not given), so the file's value or the default stays."""
    g = parser.add_argument_group("deployment (a --config file, overridden by these flags)")
    g.add_argument("--config", default=None, help="YAML deployment config (see configs/)")
    g.add_argument("--model", default=None, help="HF model directory or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=None, help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dp-size", type=int, default=None, help="data-parallel ranks")
    g.add_argument("--backend", default=None, help="ray or torchrun")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (a power of two)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None, help="memory for the paged KV cache")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides the memory size)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    g.add_argument("--torch-threads", type=int, default=None, help="torch threads per rank")
    g.add_argument("--no-zos", dest="zos", action="store_const", const=False, default=None,
                   help="disable zero-overhead scheduling")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   default=None, help="disable prefix caching")
    g.add_argument("--enable-expert-parallel", dest="enable_expert_parallel", action="store_const", const=True,
                   default=None, help="MoE models: each DP rank holds 1/dp_size of the routed experts")
    g.add_argument("--all2all-backend", default=None,
                   help="expert-parallel dispatcher: all_to_all or allgather_reducescatter")
    g.add_argument("--router-policy", default=None, help="round_robin, least_loaded or prefix_affinity")
    g.add_argument("--ray-address", default=None, help="local (a private Ray) or auto (a running cluster)")
    g.add_argument("--placement-strategy", default=None, help="pack or spread (one bundle per rank)")
    g.add_argument("--host", default=None, help="server host (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="server port (default 8000)")
    g.add_argument("--api-key", default=None, help="require this bearer token on /v1")
    g.add_argument("--metrics-port", type=int, default=None, help="separate Prometheus port")


def load_config(args: argparse.Namespace) -> DeploymentConfig:
    """The deployment of a parsed command line: --config (if any) with the given flags on top."""
    overrides = {key: getattr(args, dest) for dest, key in _FLAGS.items()
                 if getattr(args, dest, None) is not None}
    if getattr(args, "config", None):
        return load_config_file(args.config, overrides)
    return parse_config(_apply({}, overrides), "command line")
