"""Starting the OpenAI server: `deepinfer-dp serve` (add_serve_args + run_serve), run_server
for a blocking server, and ServerThread for a server in the background (tests, benchmarks).

dp_size 1 serves one in-process engine (LocalEngineClient); dp_size > 1 serves through the
router process of deepinfer_dp.cluster (RouterClient, the same EngineClient protocol). With
--api-server-count N > 1, N API server processes share the port and all talk to the router
(entrypoints/openai/api_servers.py), at any dp_size.
"""

from __future__ import annotations

import argparse
import gc
import signal
import threading

import uvicorn
from prometheus_client import start_http_server

from deepinfer_dp.config_file import DPSettings, ServerSection
from deepinfer_dp.engine.client import EngineClient
from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.draining import DEFAULT_GRACE_S, DrainingServer, exit_at_once, fail_inflight_on
from deepinfer_dp.entrypoints.openai.http_protocol import uvicorn_config
from deepinfer_dp.entrypoints.openai.server import build_app

DEFAULT_HOST = ServerSection.model_fields["host"].default  # loopback unless asked otherwise
DEFAULT_PORT = ServerSection.model_fields["port"].default
CLUSTER_STOP_S = 5.0  # after the HTTP server's drain: the router, the ranks, the private Ray instance


class ServerThread:
    """uvicorn in a background thread; `port` is the bound port (ask for 0 to get a free one)."""

    def __init__(self, client: EngineClient, served_model_name: str | list[str] | None = None,
                 api_key: str | None = None,
                 host: str = DEFAULT_HOST, port: int = 0, limits: ServerLimits | None = None) -> None:
        self.app = build_app(client, served_model_name, api_key, limits)
        self.server = uvicorn.Server(_uvicorn_config(self.app, host, port, limits, "warning"))
        self.died = _stop_when_the_engine_dies(client, self.server)
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


def run_server(client: EngineClient, served_model_name: str | list[str] | None = None, api_key: str | None = None,
               host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, metrics_port: int | None = None,
               sockets: list | None = None, limits: ServerLimits | None = None,
               shutdown_grace_s: float = DEFAULT_GRACE_S) -> int:
    """Serves until interrupted (Ctrl-C): returns 0, or 1 when the engine died (the server
    then stops by itself, so a supervisor sees the process end and restarts it). /metrics is
    always on `port`; `metrics_port` serves the same registry on a port of its own too.
    `sockets`: already listening sockets to serve on (shared by several API servers).
    On SIGTERM/SIGINT requests in flight get `shutdown_grace_s` to finish, then end with a 503
    error (entrypoints/openai/draining.py)."""
    app = build_app(client, served_model_name, api_key, limits)
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=app.state.ctx.metrics.exposed_registry())
    server = DrainingServer(_uvicorn_config(app, host, port, limits, "info"), shutdown_grace_s,
                            fail_inflight_on(client, shutdown_grace_s))
    died = _stop_when_the_engine_dies(client, server)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the
    # handler it found; with this one that ends here, so the caller stops the engine and the
    # process exits with status 0 (outside server.run the default handlers apply).
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, _already_handled) for sig in handled}
    # Everything built so far (torch, the model, the tokenizer) lives as long as the process:
    # frozen, a full collection no longer walks it. Unfrozen, the objects one large request
    # body creates set off a full collection that held the event loop for 1.0 s (vLLM freezes
    # its start-up heap the same way).
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if died else 0


def _uvicorn_config(app, host: str, port: int, limits: ServerLimits | None, log_level: str) -> uvicorn.Config:
    limits = limits or ServerLimits()
    return uvicorn_config(app, host, port, limits.request_read_timeout_s, limits.timeout_keep_alive_s, log_level)


def _already_handled(signum: int, frame) -> None:
    """uvicorn already shut the server down for this signal."""


def _stop_when_the_engine_dies(client: EngineClient, server: uvicorn.Server) -> list[BaseException]:
    """An in-process engine whose loop failed stops the server, instead of a process that is
    up but answers 503 forever. Returns the list its error lands in."""
    died: list[BaseException] = []

    def stop(error: BaseException) -> None:
        died.append(error)
        server.should_exit = True

    if hasattr(client, "on_fatal"):
        client.on_fatal = stop
    return died


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


class DPClient:
    """The router process's client (an EngineClient) over dp_size ranks started as Ray actors;
    shutdown() stops the router and the ranks too. Everything else is the client's."""

    def __init__(self, router, deployment) -> None:
        self.router = router
        self.deployment = deployment

    def __getattr__(self, name: str):
        return getattr(self.router, name)

    def shutdown(self) -> None:
        self.router.close()
        self.deployment.shutdown(CLUSTER_STOP_S)


def make_dp_client(model: str | None, dp_size: int, served_model_name: str | None = None,
                   dp_options: DPSettings | dict | None = None, **engine_options) -> DPClient:
    """dp_size ranks behind the router process of deepinfer_dp.cluster (the same EngineClient
    protocol), deployed as `dp_options` say (DPSettings.of: the settings or a dict of their names)."""
    from deepinfer_dp.cluster.dp_driver import connect, per_rank_threads
    from deepinfer_dp.cluster.ray_launcher import RayDeployment
    from deepinfer_dp.config import EngineConfig

    config = per_rank_threads(EngineConfig.from_kwargs(model=model, dp_size=dp_size, **engine_options))
    settings = DPSettings.of(dp_options)
    deployment = RayDeployment(config, settings)
    name = served_model_name or default_model_name(model)
    try:
        router = connect(deployment.frontend, deployment.infos[0], model, name, settings.router.data_plane_host,
                         deployment.key)
    except BaseException:
        deployment.shutdown()
        raise
    return DPClient(router, deployment)


def run_serve(args: argparse.Namespace) -> None:
    """Entry point of `deepinfer-dp serve` (after add_serve_args)."""
    from deepinfer_dp.config_file import ConfigError, load_config
    from deepinfer_dp.entrypoints.openai.api_key import resolve_api_key

    try:
        deployment = load_config(args, model=args.model_path)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    try:  # before anything starts, so that no child process inherits the key's variable
        key = resolve_api_key(deployment.server.api_key, deployment.server.api_key_file)
    except ValueError as e:
        raise SystemExit(f"deepinfer-dp serve: {e}") from None
    deployment.server = deployment.server.model_copy(update={"api_key": key, "api_key_file": None})
    engine = deployment.engine_options()
    names = served_names(deployment.server.served_model_name, deployment.model)
    if deployment.dp_size > 1 and deployment.backend != "ray":
        raise SystemExit("deepinfer-dp serve: serving torchrun-launched ranks is not supported yet; "
                         "use backend: ray (the default)")
    if deployment.server.api_server_count > 1:
        from deepinfer_dp.entrypoints.openai.api_servers import run_api_servers

        raise SystemExit(run_api_servers(deployment, names))
    if deployment.dp_size > 1:
        client = make_dp_client(deployment.model, deployment.dp_size, names[0], dp_options=deployment.dp_settings(),
                                **engine)
    else:
        client = make_local_client(deployment.model, names[0], **engine)
    server = deployment.server
    try:
        code = run_server(client, names, server.api_key, server.host, server.port, deployment.metrics.port,
                          limits=server.limits(), shutdown_grace_s=server.shutdown_grace_s)
    finally:
        client.shutdown()
    if code:
        raise SystemExit(f"deepinfer-dp serve: the engine failed (see the log above); exiting with status {code}")


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m deepinfer_dp.entrypoints.openai.launcher ...` without the CLI."""
    parser = add_serve_args(argparse.ArgumentParser(prog="deepinfer-dp serve"))
    with exit_at_once():
        run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    serve_main()
