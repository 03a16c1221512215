"""One DP deployment as one object: the router and rank actors under Ray and this process's
RouterClient to them, started together and stopped in one order.

DPDeployment is what the three users build: the offline driver (cluster/dp_driver.py), the
one-process server (`deepinfer-dp serve`, entrypoints/openai/launcher.py) and the parent of N
API servers (entrypoints/openai/api_servers.py), which has no client of its own: each API
server process connects with `connect` to the `frontend` and `infos[0]` it is given.
"""

from __future__ import annotations

import dataclasses
import os

from deepinfer_dp.cluster.data_plane import ClusterKey
from deepinfer_dp.cluster.ray_launcher import STOP_TIMEOUT_S, RayDeployment
from deepinfer_dp.cluster.router_client import RouterClient
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import DPSettings
from deepinfer_dp.engine.input_processor import InputProcessor
from deepinfer_dp.models.loader import resolve_model_dir
from deepinfer_dp.models.tokenizer import load_tokenizer


class DPDeployment:
    """A RayDeployment (router and rank actors, as `settings` say) and, unless `client_name` is
    None, a RouterClient to it that answers as `client_name` (`router`). shutdown() closes the
    client first, then stops the actors (and the private Ray instance) within `stop_s`; a
    client that fails to connect stops the actors before the error goes up."""

    def __init__(self, config: EngineConfig, settings: DPSettings, client_name: str | None,
                 stop_s: float = STOP_TIMEOUT_S) -> None:
        self.config = per_rank_threads(config)
        self._stop_s = stop_s
        self._closed = False
        self._cluster = RayDeployment(self.config, settings)
        self._router: RouterClient | None = None
        if client_name is not None:
            try:
                self._router = connect(self.frontend, self.infos[0], self.config, client_name,
                                       settings.router.data_plane_host, self.key)
            except BaseException:
                self._cluster.shutdown()
                raise

    @property
    def router(self) -> RouterClient:
        """This process's client of the router (an EngineClient)."""
        if self._router is None:
            raise RuntimeError("this deployment was started without a router client (client_name=None)")
        return self._router

    @property
    def frontend(self) -> str:
        """The router's address for clients."""
        return self._cluster.frontend

    @property
    def infos(self) -> list[dict]:
        """The first ranks' (address, pid, vocab_size, max_model_len, ...)."""
        return self._cluster.infos

    @property
    def key(self) -> ClusterKey | None:
        """The data plane's key, every role's (None only with data_plane_auth off)."""
        return self._cluster.key

    @property
    def router_pid(self) -> int:
        """The router's process id as last seen by the watch thread."""
        return self._cluster.router_pid

    def router_process(self) -> int:
        return self._cluster.router_process()

    def rank_infos(self) -> list[dict]:
        return self._cluster.rank_infos()

    def kill_rank(self, dp_rank: int) -> None:
        self._cluster.kill_rank(dp_rank)

    def spare_pid(self) -> int | None:
        return self._cluster.spare_pid()

    def scale(self, new_size: int, drain_timeout_s: float) -> dict:
        """Grows or shrinks the DP group while it serves (RayDeployment.scale; ScaleError)."""
        return self._cluster.scale(new_size, drain_timeout_s)

    def is_scaling(self) -> bool:
        return self._cluster.is_scaling()

    def shutdown(self) -> None:
        """The client, then the router and the ranks; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._router is not None:
            self._router.close()
        self._cluster.shutdown(self._stop_s)


def per_rank_threads(config: EngineConfig) -> EngineConfig:
    """On the CPU, one share of the cores per rank unless torch_threads says otherwise: ranks
    oversubscribing the cores would slow each other."""
    if config.torch_threads is None and config.torch_device().type == "cpu":
        return dataclasses.replace(config, torch_threads=max(1, (os.cpu_count() or 1) // config.dp_size))
    return config


def connect(frontend: str, rank_info: dict, config: EngineConfig, model_name: str,
            host: str = "127.0.0.1", key: ClusterKey | None = None, dp_ranks: list[int] | None = None) -> RouterClient:
    """A RouterClient to the router at `frontend`, with this process's own tokenizer (an API
    server detokenizes itself; `config` names the model, its revision and the tokenizer), the
    ranks' limits (`rank_info`) for validation and the data plane's key (RayDeployment.key).
    `dp_ranks`: the ranks that router serves (default: all of config.dp_size)."""
    info = rank_info
    model_dir = resolve_model_dir(config.model, config.revision)
    tokenizer = load_tokenizer(model_dir, config.tokenizer)
    processor = InputProcessor(info["vocab_size"], info["max_model_len"], info.get("sampling_defaults"))
    images = None
    if info.get("takes_images"):  # a vision model: the processor's chat template, the references checked here
        from deepinfer_dp.multimodal.front import ImageFront

        images = ImageFront.for_model(model_dir, config.media_limits(), config.limit_mm_per_prompt.get("image", 0))
    ranks = list(range(config.dp_size)) if dp_ranks is None else dp_ranks
    return RouterClient(frontend, tokenizer, model_name, info["max_model_len"], processor, host, key=key,
                        images=images, dp_ranks=ranks)
