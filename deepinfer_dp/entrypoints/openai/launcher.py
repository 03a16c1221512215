"""Starting the OpenAI server: `deepinfer-dp serve` (add_serve_args + run_serve), run_server
for a blocking server, and ServerThread for a server in the background (tests, benchmarks).

dp_size 1 serves one in-process engine (LocalEngineClient); dp_size > 1 serves the DP
router of deepinfer_dp.cluster, which implements the same EngineClient protocol.
"""

from __future__ import annotations

import argparse
import threading

import uvicorn
from prometheus_client import start_http_server

from deepinfer_dp.engine.client import EngineClient
from deepinfer_dp.entrypoints.openai.server import build_app

DEFAULT_HOST = "127.0.0.1"  # loopback unless asked otherwise
DEFAULT_PORT = 8000


class ServerThread:
    """uvicorn in a background thread; `port` is the bound port (ask for 0 to get a free one)."""

    def __init__(self, client: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
                 host: str = DEFAULT_HOST, port: int = 0) -> None:
        self.app = build_app(client, served_model_name, api_key)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
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


def run_server(client: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
               host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, metrics_port: int | None = None) -> None:
    """Serves until interrupted (Ctrl-C). /metrics is always on `port`; `metrics_port` serves
    the same registry on a port of its own too (for scrapers kept off the API port)."""
    app = build_app(client, served_model_name, api_key)
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=app.state.ctx.metrics.registry)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", lifespan="off")).run()


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`deepinfer-dp serve [MODEL] [--config FILE] [flags]`: the deployment flags of
    deepinfer_dp.config_file (a flag given wins over the file) plus the server's own."""
    from deepinfer_dp.config_file import add_config_args

    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="Hugging Face directory or .gguf file (the same as --model)")
    add_config_args(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model's name)")
    return parser


def default_model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def make_local_client(model: str | None, served_model_name: str | None = None,
                      **engine_options) -> EngineClient:
    """One in-process engine (dp_size 1) behind the EngineClient protocol."""
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.engine.llm_engine import LLMEngine
    from deepinfer_dp.entrypoints.openai.local_client import LocalEngineClient

    engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
    return LocalEngineClient(engine, served_model_name or default_model_name(model))


class DPClient:
    """The DP router (an EngineClient) over dp_size ranks started as Ray actors; shutdown()
    stops the ranks too. Everything else is the router's."""

    def __init__(self, dp_engine, served_model_name: str) -> None:
        self.dp_engine = dp_engine
        self.router = dp_engine.router
        self.router.model_name = served_model_name

    def __getattr__(self, name: str):
        return getattr(self.router, name)

    def shutdown(self) -> None:
        self.dp_engine.shutdown()


def make_dp_client(model: str | None, dp_size: int, served_model_name: str | None = None,
                   policy: str = "round_robin", dp_options: dict | None = None, **engine_options) -> DPClient:
    """dp_size ranks behind the router of deepinfer_dp.cluster (the same EngineClient protocol)."""
    from deepinfer_dp.cluster.offline import DPEngine
    from deepinfer_dp.config import EngineConfig

    config = EngineConfig.from_kwargs(model=model, dp_size=dp_size, **engine_options)
    options = {"policy": policy, **(dp_options or {})}
    return DPClient(DPEngine(config, **options), served_model_name or default_model_name(model))


def run_serve(args: argparse.Namespace) -> None:
    """Entry point of `deepinfer-dp serve` (after add_serve_args)."""
    from deepinfer_dp.config_file import ConfigError, load_config

    if args.model_path is not None:
        args.model = args.model or args.model_path
    try:
        deployment = load_config(args)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    engine = deployment.engine_options()
    name = args.served_model_name or default_model_name(deployment.model)
    if deployment.dp_size > 1 and deployment.backend != "ray":
        raise SystemExit("deepinfer-dp serve: serving torchrun-launched ranks is not supported yet; "
                         "use backend: ray (the default)")
    if deployment.dp_size > 1:
        client = make_dp_client(deployment.model, deployment.dp_size, name, dp_options=deployment.dp_options(),
                                **engine)
    else:
        client = make_local_client(deployment.model, name, **engine)
    server = deployment.server
    try:
        run_server(client, name, server.api_key, server.host, server.port, deployment.metrics.port)
    finally:
        client.shutdown()


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m deepinfer_dp.entrypoints.openai.launcher ...` without the CLI."""
    parser = add_serve_args(argparse.ArgumentParser(prog="deepinfer-dp serve"))
    run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    serve_main()
