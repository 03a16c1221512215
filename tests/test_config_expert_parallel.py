"""The expert-parallel options, vLLM's names: `enable_expert_parallel` / `all2all_backend` in a
YAML config, `--enable-expert-parallel` / `--all2all-backend` on the command line (a flag wins
over the file), both ending in EngineConfig; a bad backend is named."""

from __future__ import annotations

import argparse

import pytest

from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import ConfigError, add_config_args, load_config, load_config_file


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return parser.parse_args(argv)


def test_yaml_and_flags_reach_the_engine_config(tmp_path):
    path = tmp_path / "ep.yaml"
    path.write_text("dp_size: 2\nenable_expert_parallel: true\nall2all_backend: allgather_reducescatter\n")
    engine = load_config_file(path).engine_config()
    assert engine.enable_expert_parallel and engine.all2all_backend == "allgather_reducescatter"
    flags = load_config(_parse(["--config", str(path), "--all2all-backend", "all_to_all"])).engine_config()
    assert flags.enable_expert_parallel and flags.all2all_backend == "all_to_all"
    assert load_config(_parse(["--enable-expert-parallel"])).engine_config().enable_expert_parallel
    assert not load_config(_parse([])).engine_config().enable_expert_parallel


def test_bad_backend_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("all2all_backend: deepep\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid config: all2all_backend"):
        load_config_file(path)
    with pytest.raises(ValueError, match="all2all_backend\n.*'all_to_all' or 'allgather_reducescatter'"):
        EngineConfig(all2all_backend="deepep")
