"""YAML deployment configs and the command-line flags, both derived from the config classes.

A deployment is every EngineConfig option at the top level (see deepinfer_dp/config.py, where
each option is declared once) plus the sections below (router, ray, server, metrics). An
unknown key, a wrong type or an impossible value stops with ONE ConfigError naming the file
and the key (e.g. `configs/x.yaml: invalid config: router.policy: ...`).

add_config_args(parser) adds `--config FILE` and one flag per option: `--max-num-seqs` for an
engine option, `--router-policy` for `router.policy` (section flags carry the section's
prefix, except the server's: `--host`, `--port`); booleans get `--zos` / `--no-zos`.
load_config(args) reads the file first, then every flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

from deepinfer_dp.config import EngineConfig, describe_errors, engine_fields


class ConfigError(ValueError):
    """A deployment config that cannot run; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RouterSection(_Section):
    policy: Literal["round_robin", "least_loaded", "prefix_affinity", "cache_aware"] = Field(
        "cache_aware", description="how the router picks a rank for a request (docs/data_parallel.md, "
                                   "\"Routing policies\")")
    collective_timeout_s: float = Field(30.0, gt=0, description="timeout of the lockstep vote; a rank "
                                                                "silent this long is declared dead")
    max_rank_restarts: int = Field(3, ge=0, description="times a dead DP rank is restarted (a new process "
                                                        "that rejoins the group); 0: it stays down")
    data_plane_auth: Literal["auto", "on", "off"] = Field(
        "auto", description="CURVE authentication and encryption of every data-plane socket, loopback "
                            "included (auto and on are the same); off is unsafe: any local process can "
                            "then drive the cluster and stop its ranks")
    rank_loss: Literal["restart", "shrink"] = Field(
        "restart", description="what a dead DP rank leads to: restart (its requests fail, a new process "
                               "replaces it, up to max_rank_restarts) or shrink (the survivors re-form without "
                               "it for good, take over its requests by recompute and its experts; "
                               "docs/elastic.md)")
    spare_rank: bool = Field(True, description="keep one idle rank process with its imports done (CPU "
                                               "ranks), so that a dead rank is replaced faster")
    data_plane_host: str = Field("127.0.0.1", min_length=1, description="the address the router's and the "
                                 "ranks' ZeroMQ sockets bind (across nodes: one the other nodes reach)")


class RaySection(_Section):
    address: str = Field("local", description="local (a private Ray instance) or auto (the running cluster)")
    placement_strategy: Literal["pack", "spread"] = Field("pack", description="one bundle per rank: pack "
                                                                              "or spread them over nodes")


class ServerSection(_Section):
    host: str = Field("127.0.0.1", description="the HTTP server's address")
    port: int = Field(8000, ge=0, le=65535, description="the HTTP server's port")
    api_key: str | None = Field(None, description="require this bearer token on /v1 (visible in the process "
                                                  "list: prefer --api-key-file or DEEPINFER_DP_API_KEY)")
    api_key_file: str | None = Field(None, description="read the bearer token required on /v1 from this file "
                                                       "(its first line)")
    served_model_name: list[str] | None = Field(None, description="the names clients may send as `model`, several "
                                                "allowed (default: the model argument as given)")
    api_server_count: int = Field(1, ge=1, description="API server processes sharing the port (more than "
                                                       "one serves through the router process)")
    shutdown_grace_s: float = Field(3.0, ge=0, description="on SIGTERM/SIGINT, how long requests in flight may "
                                                           "finish before they end with an error")
    # Bounds on requests (see entrypoints/openai/admission.py): 413 / 400 / 503 past them.
    max_request_body_bytes: int = Field(16 * 2**20, ge=1024, description="larger request bodies get 413")
    max_n: int = Field(128, ge=1, description="most choices (n) in one request")
    max_prompts: int = Field(256, ge=1, description="most prompts in one completions request")
    max_waiting_requests: int = Field(1024, ge=1, description="requests waiting for their first token "
                                                              "(server-wide) before new ones get 503")
    chat_special_tokens_as_text: bool = Field(True, description="special-token strings typed in chat "
                                                                "content stay text (not control tokens), "
                                                                "and template variables may not hold them")
    chat_template: str | None = Field(None, description="the chat template of /v1/chat/completions, a Jinja "
                                      "file or the template itself (default: the model's; needed for a model "
                                      "without one, such as a base GGUF file)")
    enable_auto_tool_choice: bool = Field(False, description="serve tool_choice \"auto\" (the default with "
                                                             "tools): read tool calls out of free text")
    tool_call_parser: Literal["hermes"] = Field("hermes", description="the format the model writes tool calls "
                                                "in: hermes = <tool_call>{...}</tool_call> (Qwen2.5/Qwen3, Hermes)")
    # Slow clients and frozen ranks (see entrypoints/openai/http_protocol.py and /health).
    request_read_timeout_s: float = Field(10.0, gt=0, description="a request's headers and body must arrive "
                                          "within this time of its first byte; else 408 and the connection closes")
    timeout_keep_alive_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    stall_timeout_s: float = Field(5.0, gt=0, description="/health reports a DP rank stalled (503) when it has work "
                                   "and has finished no step for this long")
    enable_elastic_ep: bool = Field(False, description="serve POST /scale_elastic_ep and GET /is_scaling_elastic_ep: "
                                    "grow or shrink the DP group while serving (dp_size > 1 over Ray, one API server)")

    def limits(self) -> ServerLimits:
        return ServerLimits(self.max_request_body_bytes, self.max_n, self.max_prompts, self.max_waiting_requests,
                            self.chat_special_tokens_as_text,
                            self.tool_call_parser if self.enable_auto_tool_choice else None,
                            self.request_read_timeout_s, self.timeout_keep_alive_s, self.stall_timeout_s,
                            self.chat_template)


# The server section as the HTTP front reads it (entrypoints/openai/admission.py enforces it):
# declared here, with the section, so that the declarations import nothing above them. Its
# defaults are the section's.
def _server_default(name: str) -> Any:
    return ServerSection.model_fields[name].default


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = _server_default("max_request_body_bytes")
    max_n: int = _server_default("max_n")
    max_prompts: int = _server_default("max_prompts")  # prompts in one completions request
    max_waiting_requests: int = _server_default("max_waiting_requests")  # admitted, not yet at their first token
    chat_special_tokens_as_text: bool = _server_default("chat_special_tokens_as_text")
    tool_call_parser: str | None = None  # reads tool calls for tool_choice "auto"; None: auto refused
    request_read_timeout_s: float = _server_default("request_read_timeout_s")  # else 408
    timeout_keep_alive_s: float = _server_default("timeout_keep_alive_s")
    stall_timeout_s: float = _server_default("stall_timeout_s")
    chat_template: str | None = None  # the template's text (serve reads --chat-template once, at start)


class MetricsSection(_Section):
    port: int | None = Field(None, ge=0, le=65535, description="a separate Prometheus port (default: "
                                                               "/metrics on the server's port only)")


class DPSettings(_Section):
    """A Ray DP deployment's router and Ray sections, as the launchers take them (RayDeployment,
    DPDriver, LLM(dp_options=...), make_dp_deployment): the declared sections themselves."""
    router: RouterSection = RouterSection()
    ray: RaySection = RaySection()

    @classmethod
    def of(cls, options: DPSettings | dict[str, Any] | None) -> DPSettings:
        """The settings, or a flat dict of the sections' own field names as LLM(dp_options=...)
        takes it ({"policy": "least_loaded", "max_rank_restarts": 0}); a ValueError names an
        unknown key or a bad value."""
        if isinstance(options, DPSettings):
            return options
        parts: dict[str, dict[str, Any]] = {"router": {}, "ray": {}}
        for key, value in (options or {}).items():
            section = next((name for name in parts if key in cls.model_fields[name].annotation.model_fields), None)
            if section is None:
                known = [k for name in parts for k in cls.model_fields[name].annotation.model_fields]
                raise ValueError(f"dp_options: unknown option {key!r} (known: {', '.join(known)})")
            parts[section][key] = value
        try:
            return cls.model_validate(parts)
        except ValidationError as e:
            raise ValueError("invalid dp_options: " + describe_errors(e)) from None


class DataParallelSection(_Section):
    """vLLM's hybrid and external load-balancing modes (docs/lb_modes.md): servers started
    separately, each serving its own ranks, in one lockstep group."""
    rank: int | None = Field(None, ge=0, description="external load balancing: this server is DP rank RANK of "
                             "dp_size, with its own endpoint; the others are started separately")
    hybrid_lb: bool = Field(False, description="hybrid load balancing: this server runs and serves its node's "
                            "size_local ranks from start_rank; the other nodes run their own")
    size_local: int | None = Field(None, ge=1, description="hybrid: the DP ranks this node runs")
    start_rank: int | None = Field(None, ge=0, description="hybrid: the first of this node's DP ranks")
    address: str = Field("127.0.0.1", min_length=1, description="hybrid and external: the address of DP rank 0's "
                         "node, where the group's store is served")
    rpc_port: int = Field(29550, ge=1, le=65535, description="hybrid and external: the store's port at address")
    key_file: str | None = Field(None, description="hybrid and external: a file whose first line is the group's "
                                 "shared secret (e.g. openssl rand -hex 32), from which every server derives the "
                                 "data plane's keys; required unless router.data_plane_auth is off")

    def local_ranks(self) -> range | None:
        """The ranks this server runs and serves; None in internal mode (all, under Ray)."""
        if self.rank is not None:
            return range(self.rank, self.rank + 1)
        if self.hybrid_lb:
            return range(self.start_rank, self.start_rank + self.size_local)
        return None

    @model_validator(mode="after")
    def _one_mode(self) -> DataParallelSection:
        if self.rank is not None and self.hybrid_lb:
            raise ValueError("rank (external mode) and hybrid_lb exclude each other")
        if self.hybrid_lb and (self.size_local is None or self.start_rank is None):
            raise ValueError("hybrid_lb needs size_local and start_rank")
        if not self.hybrid_lb and (self.size_local is not None or self.start_rank is not None):
            raise ValueError("size_local and start_rank are hybrid_lb's (add --data-parallel-hybrid-lb)")
        return self


# section -> (its model, the prefix of its flags)
SECTIONS: dict[str, tuple[type[_Section], str]] = {
    "router": (RouterSection, "router-"), "ray": (RaySection, "ray-"),
    "server": (ServerSection, ""), "metrics": (MetricsSection, "metrics-"),
    "data_parallel": (DataParallelSection, "data-parallel-"),
}
# vLLM's names of our flags, accepted as well
FLAG_ALIASES = {"dp_size": ("--data-parallel-size",)}


class _DeploymentBase(_Section):
    backend: Literal["ray", "torchrun"] = Field("ray", description="how DP ranks are started")

    @model_validator(mode="after")
    def _fits_this_machine(self) -> _DeploymentBase:
        local = self.data_parallel.local_ranks()
        if local is not None and local.stop > self.dp_size:
            raise ValueError(f"data_parallel: this server's DP ranks {list(local)} are not all below "
                             f"dp_size={self.dp_size}")
        # A remote Ray cluster has its own devices; only a local deployment is checked here.
        if local is None and self.backend == "ray" and self.ray.address != "local":
            return self
        available, kind = _local_devices(self.device)
        wanted = self.dp_size if local is None else len(local)
        if wanted > available:
            raise ValueError(f"dp_size: {wanted} ranks need more than the {available} {kind} "
                             f"available on this machine")
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in engine_fields()})

    def engine_options(self) -> dict[str, Any]:
        """The engine options as LLM(...) keywords, the model and dp_size left out."""
        return {k: getattr(self, k) for k in engine_fields() if k not in ("model", "dp_size")}

    def dp_settings(self) -> DPSettings:
        """The router and Ray sections, for LLM(dp_options=...) when dp_size > 1 under Ray."""
        return DPSettings(router=self.router, ray=self.ray)


DeploymentConfig = create_model(
    "DeploymentConfig", __base__=_DeploymentBase,
    **{name: (f.annotation, f) for name, f in engine_fields().items()},
    **{name: (model, model()) for name, (model, _) in SECTIONS.items()})


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
        raise ConfigError(f"{source}: invalid config: " + describe_errors(e)) from None


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


# ---- the command line -----------------------------------------------------------------------
def _options() -> list[tuple[str, str, FieldInfo]]:
    """(flag, dotted config key, field) of every deployment option."""
    top = {**engine_fields(), "backend": _DeploymentBase.model_fields["backend"]}
    out = [("--" + name.replace("_", "-"), name, f) for name, f in top.items()]
    for section, (model, prefix) in SECTIONS.items():
        out += [(f"--{prefix}{name.replace('_', '-')}", f"{section}.{name}", f)
                for name, f in model.model_fields.items()]
    return out


def _dest(key: str) -> str:
    return "config__" + key.replace(".", "__")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """--config FILE plus one flag per option. Every flag defaults to None (= not given), so
    the file's value or the option's default stays."""
    g = parser.add_argument_group("deployment (a --config file, overridden by these flags)")
    g.add_argument("--config", default=None, help="YAML deployment config (see configs/)")
    for flag, key, f in _options():
        _add_flag(g, flag, key, f, FLAG_ALIASES.get(key, ()))


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig option but `exclude`, the same flags as deepinfer-dp's, for a
    launcher that takes no deployment file (launch/torchrun_generate.py); engine_options_of
    reads them back."""
    g = parser.add_argument_group("engine (EngineConfig options, deepinfer_dp/config.py)")
    for name, f in engine_fields().items():
        if name not in exclude:
            _add_flag(g, "--" + name.replace("_", "-"), name, f)


def engine_options_of(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (add_engine_args); the others are left
    out, so EngineConfig's defaults apply."""
    return {name: getattr(args, _dest(name)) for name in engine_fields()
            if getattr(args, _dest(name), None) is not None}


def _add_flag(g: argparse._ArgumentGroup, flag: str, key: str, f: FieldInfo, aliases: tuple[str, ...] = ()) -> None:
    """The flag of one option (and its `aliases`); it defaults to None (not given), its help
    shows the declared default."""
    flag = (flag, *aliases)
    kind = _scalar_type(f.annotation)
    default = "" if f.default is None else f" (default: {f.default})"
    if kind is dict or issubclass(kind, BaseModel):  # a mapping option: one JSON object on the command line
        g.add_argument(*flag, dest=_dest(key), type=_json_object, default=None, metavar="JSON",
                       help=f"{f.description}{default}")
    elif kind is list:  # several values: --served-model-name a b
        g.add_argument(*flag, dest=_dest(key), nargs="+", default=None, help=f"{f.description}{default}")
    elif kind is bool:
        g.add_argument(*flag, dest=_dest(key), action=argparse.BooleanOptionalAction, default=None,
                       help=f"{f.description}{default}")
    else:  # values are checked by the config's validation, the same as a file's
        choices = typing.get_args(f.annotation) if typing.get_origin(f.annotation) is Literal else ()
        metavar = "{" + ",".join(choices) + "}" if choices else key.rsplit(".", 1)[-1].upper()
        g.add_argument(*flag, dest=_dest(key), type=kind, default=None, metavar=metavar,
                       help=f"{f.description}{default}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
    return value


def _scalar_type(annotation: Any) -> type:
    """int for `int | None`, str for a Literal of strings, and so on."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_origin(annotation) or annotation  # dict for dict[str, Any]


def load_config(args: argparse.Namespace, model: str | None = None) -> DeploymentConfig:
    """The deployment of a parsed command line: --config (if any) with the given flags on top.
    `model` (a positional MODEL argument) counts when --model is not given."""
    overrides = {key: getattr(args, _dest(key)) for _, key, _ in _options()
                 if getattr(args, _dest(key), None) is not None}
    if model is not None:
        overrides.setdefault("model", model)
    if getattr(args, "config", None):
        return load_config_file(args.config, overrides)
    return parse_config(_apply({}, overrides), "command line")
