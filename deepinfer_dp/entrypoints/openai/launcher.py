"""Starting the OpenAI server: `deepinfer-dp serve` (add_serve_args + run_serve), and
ServerThread for a server in the background (tests, benchmarks); run_server, the blocking
server, lives in http_server.py (re-exported here) so that api_servers.py needs nothing from here.

dp_size 1 serves one in-process engine (LocalEngineClient); dp_size > 1 serves through the
router process of deepinfer_dp.cluster (RouterClient, the same EngineClient protocol). With
--api-server-count N > 1, N API server processes share the port and all talk to the router
(entrypoints/openai/api_servers.py), at any dp_size.
"""

from __future__ import annotations

import argparse
import threading
from typing import TYPE_CHECKING

import uvicorn

from deepinfer_dp.config_file import DPSettings
from deepinfer_dp.engine.client import EngineClient
from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.api_servers import run_api_servers
from deepinfer_dp.entrypoints.openai.draining import exit_at_once
from deepinfer_dp.entrypoints.openai.http_server import (  # noqa: F401 (DEFAULT_PORT, run_server: re-exported)
    DEFAULT_HOST,
    DEFAULT_PORT,
    run_server,
    server_config,
    stop_when_the_engine_dies,
)
from deepinfer_dp.entrypoints.openai.server import build_app

if TYPE_CHECKING:
    from deepinfer_dp.cluster.deployment import DPDeployment

CLUSTER_STOP_S = 4.0  # after the HTTP server's drain: the router, the ranks, the private Ray instance


class ServerThread:
    """uvicorn in a background thread; `port` is the bound port (ask for 0 to get a free one)."""

    def __init__(self, client: EngineClient, served_model_name: str | list[str] | None = None,
                 api_key: str | None = None,
                 host: str = DEFAULT_HOST, port: int = 0, limits: ServerLimits | None = None,
                 model_root: str | None = None, scaler=None) -> None:
        self.app = build_app(client, served_model_name, api_key, limits, model_root, scaler)
        self.server = uvicorn.Server(server_config(self.app, host, port, limits, "warning"))
        self.died = stop_when_the_engine_dies(client, self.server)
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="deepinfer-http", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server failed to start (see the log above)")
            self._thread.join(timeout=0.05)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`deepinfer-dp serve [MODEL] [--config FILE] [flags]`: the deployment flags of
    deepinfer_dp.config_file (a flag given wins over the file) plus the server's own."""
    from deepinfer_dp.config_file import add_config_args

    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="Hugging Face directory or .gguf file (the same as --model)")
    add_config_args(parser)  # --served-model-name among them (ServerSection)
    return parser


# The default model's names: its own, and the Hugging Face repo id that vLLM users send.
DEFAULT_MODEL_NAMES = ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]


def default_model_name(model: str | None) -> str:
    """The model argument as given, as vLLM serves it (the default model's own name for None)."""
    return DEFAULT_MODEL_NAMES[0] if model is None else model


def model_root(model: str | None) -> str:
    """The model a /v1/models card names as its root: the model argument as given (the default
    model's repo id for none)."""
    return DEFAULT_MODEL_NAMES[1] if model is None else model


def served_names(names: list[str] | None, model: str | None) -> list[str]:
    """What clients may send as `model`: --served-model-name, else the model as given; the
    first name is the one answers carry."""
    if names:
        return list(names)
    return list(DEFAULT_MODEL_NAMES) if model is None else [model]


def make_local_client(model: str | None, served_model_name: str | None = None,
                      **engine_options) -> EngineClient:
    """One in-process engine (dp_size 1) behind the EngineClient protocol."""
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.engine.llm_engine import LLMEngine
    from deepinfer_dp.entrypoints.openai.local_client import LocalEngineClient

    engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
    return LocalEngineClient(engine, served_model_name or default_model_name(model))


def make_dp_deployment(model: str | None, dp_size: int, served_model_name: str | None = None,
                       dp_options: DPSettings | dict | None = None, **engine_options) -> DPDeployment:
    """dp_size ranks behind the router process of deepinfer_dp.cluster, deployed as `dp_options`
    say (DPSettings.of: the settings or a dict of their names); its `router` is the EngineClient
    to serve, and shutdown() stops the cluster within CLUSTER_STOP_S."""
    from deepinfer_dp.cluster.deployment import DPDeployment
    from deepinfer_dp.config import EngineConfig

    config = EngineConfig.from_kwargs(model=model, dp_size=dp_size, **engine_options)
    return DPDeployment(config, DPSettings.of(dp_options), served_model_name or default_model_name(model),
                        stop_s=CLUSTER_STOP_S)


def run_serve(args: argparse.Namespace) -> None:
    """Entry point of `deepinfer-dp serve` (after add_serve_args)."""
    from deepinfer_dp.config_file import ConfigError, load_config
    from deepinfer_dp.entrypoints.openai.api_key import resolve_api_key
    from deepinfer_dp.utils.chat_template import load_chat_template

    try:
        deployment = load_config(args, model=args.model_path)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    try:  # before anything starts, so that no child process inherits the key's variable
        key = resolve_api_key(deployment.server.api_key, deployment.server.api_key_file)
        template = load_chat_template(deployment.server.chat_template)  # once: API servers get its text
    except ValueError as e:
        raise SystemExit(f"deepinfer-dp serve: {e}") from None
    deployment.server = deployment.server.model_copy(update={"api_key": key, "api_key_file": None,
                                                             "chat_template": template})
    engine = deployment.engine_options()
    names = served_names(deployment.server.served_model_name, deployment.model)
    if deployment.data_parallel.local_ranks() is not None:
        code = run_lb_server(deployment, names)
        if code:
            raise SystemExit(f"deepinfer-dp serve: the DP group broke (see the log above); exiting with status {code}")
        return
    if deployment.dp_size > 1 and deployment.backend != "ray":
        raise SystemExit("deepinfer-dp serve: serving torchrun-launched ranks is not supported yet; "
                         "use backend: ray (the default)")
    if deployment.server.enable_elastic_ep and (deployment.dp_size < 2 or deployment.server.api_server_count > 1):
        raise SystemExit("deepinfer-dp serve: --enable-elastic-ep needs dp_size > 1 over Ray (the router changes "
                         "the group's size) and one API server (--api-server-count 1): it scales through the "
                         "deployment this process started")
    if deployment.server.api_server_count > 1:
        raise SystemExit(run_api_servers(deployment, names, model_root(deployment.model)))
    if deployment.dp_size > 1:
        dp = make_dp_deployment(deployment.model, deployment.dp_size, names[0],
                                dp_options=deployment.dp_settings(), **engine)
        client, stop = dp.router, dp.shutdown
        scaler = dp if deployment.server.enable_elastic_ep else None
    else:
        client = make_local_client(deployment.model, names[0], **engine)
        stop, scaler = client.shutdown, None
    server = deployment.server
    try:
        code = run_server(client, names, server.api_key, server.host, server.port, deployment.metrics.port,
                          limits=server.limits(), shutdown_grace_s=server.shutdown_grace_s,
                          model_root=model_root(deployment.model), scaler=scaler)
    finally:
        stop()
    if code:
        raise SystemExit(f"deepinfer-dp serve: the engine failed (see the log above); exiting with status {code}")


def run_lb_server(deployment, names: list[str]) -> int:
    """Hybrid or external load balancing (docs/lb_modes.md): this server's ranks, started here,
    in a group with the other servers', behind this endpoint; returns the exit status."""
    from deepinfer_dp.cluster.lb_node import LBNode

    server = deployment.server
    if server.api_server_count > 1:
        raise SystemExit("deepinfer-dp serve: --api-server-count is not supported with --data-parallel-rank or "
                         "--data-parallel-hybrid-lb (each server is one API server process)")
    try:
        node = LBNode(deployment.engine_config(), deployment.dp_settings(), deployment.data_parallel,
                      deployment.data_parallel.local_ranks(), names[0])
    except (ValueError, RuntimeError) as e:  # a missing key file, a rank that could not join its group
        raise SystemExit(f"deepinfer-dp serve: {e}") from None
    try:
        return run_server(node.client, names, server.api_key, server.host, server.port, deployment.metrics.port,
                          limits=server.limits(), shutdown_grace_s=server.shutdown_grace_s,
                          model_root=model_root(deployment.model))
    finally:
        node.shutdown()


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m deepinfer_dp.entrypoints.openai.launcher ...` without the CLI."""
    parser = add_serve_args(argparse.ArgumentParser(prog="deepinfer-dp serve"))
    with exit_at_once():
        run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    serve_main()
