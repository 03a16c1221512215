"""YAML deployment configs: the shipped ones load, bad ones stop with one clear message
naming the file and the key, and command-line flags override the file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from deepinfer_dp.config_file import (
    ConfigError,
    DPSettings,
    RaySection,
    RouterSection,
    add_config_args,
    load_config,
    load_config_file,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["smollm2_dp1.yaml", "smollm2_dp2.yaml", "tiny_test.yaml",
                                  "deepseek_v3_dp2_ep_mtp.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config_file(CONFIGS / name)
    engine = cfg.engine_config()
    assert engine.dp_size == cfg.dp_size and engine.block_size == cfg.block_size


def test_dp2_config_becomes_engine_config_and_dp_settings():
    cfg = load_config_file(CONFIGS / "smollm2_dp2.yaml")
    assert cfg.engine_config().torch_threads == 1
    settings = cfg.dp_settings()
    assert settings.router is cfg.router and settings.ray is cfg.ray  # the sections themselves, no copies
    assert settings.router.policy == "least_loaded" and settings.router.max_rank_restarts == 3


def test_dp_options_dict_uses_the_sections_own_names():
    settings = DPSettings.of({"policy": "least_loaded", "placement_strategy": "spread", "max_rank_restarts": 0})
    assert settings == DPSettings(router=RouterSection(policy="least_loaded", max_rank_restarts=0),
                                  ray=RaySection(placement_strategy="spread"))
    assert DPSettings.of(None) == DPSettings() and DPSettings.of(settings) is settings
    with pytest.raises(ValueError, match="unknown option 'strategy'"):
        DPSettings.of({"strategy": "spread"})
    with pytest.raises(ValueError, match="router.collective_timeout_s"):
        DPSettings.of({"collective_timeout_s": -1})


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key, words", [
    ("max_num_seqs: 8\nbogus_key: 1\n", "bogus_key", "unknown key"),
    ("router:\n  policy: fastest\n", "router.policy", "round_robin"),
    ("max_num_seqs: '8'\n", "max_num_seqs", "valid integer"),
    ("zos: 3\n", "zos", "valid boolean"),
    ("block_size: 12\n", "block_size", "power of two"),
    ("block_size: 0\n", "block_size", "greater than or equal to 1"),
    ("dp_vote_interval: 0\n", "dp_vote_interval", "greater than or equal to 1"),
    (f"dp_size: {(os.cpu_count() or 1) + 1}\ndevice: cpu\n", "dp_size", "available on this machine"),
    ("server:\n  port: 70000\n", "server.port", "65535"),
    ("ray:\n  placement_strategy: scatter\n", "ray.placement_strategy", "pack"),
    ("backend: slurm\n", "backend", "ray"),
])
def test_bad_config_names_the_file_and_the_key(tmp_path, text, key, words):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid config: {key}: ")
    assert words in message
    assert "\n" not in message  # one message, one line


def test_dp_size_is_not_checked_against_a_remote_ray_cluster(tmp_path):
    path = _write(tmp_path, "dp_size: 64\nray:\n  address: auto\n")
    assert load_config_file(path).dp_size == 64


def test_missing_file_and_broken_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config_file(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config_file(_write(tmp_path, "- a\n- b\n"))


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return load_config(parser.parse_args(argv))


def test_flags_override_the_file():
    cfg = _parse(["--config", str(CONFIGS / "smollm2_dp2.yaml"), "--dp-size", "1", "--router-policy",
                  "round_robin", "--port", "9000", "--no-zos", "--block-size", "32"])
    assert (cfg.dp_size, cfg.router.policy, cfg.server.port, cfg.zos, cfg.block_size) == \
        (1, "round_robin", 9000, False, 32)
    assert cfg.max_num_seqs == 64  # from the file
    assert cfg.server.host == "127.0.0.1"


def test_flags_without_a_file_and_bad_flag_value():
    cfg = _parse(["--max-num-seqs", "4", "--no-enable-prefix-caching", "--dp-vote-interval", "32"])
    assert cfg.max_num_seqs == 4 and cfg.enable_prefix_caching is False and cfg.dp_size == 1
    assert cfg.engine_config().dp_vote_interval == 32 and _parse([]).dp_vote_interval == 1
    with pytest.raises(ConfigError, match=r"^command line: invalid config: router.policy: "):
        _parse(["--router-policy", "fastest"])



def test_every_engine_option_is_a_yaml_key_and_a_flag():
    from deepinfer_dp.config import EngineConfig, engine_fields

    names = set(engine_fields())
    assert {"cpu_linear_kernel", "seed", "zos", "max_num_seqs"} <= names
    assert "dp_rank" not in names  # set by the launchers only
    from deepinfer_dp.config_file import DeploymentConfig

    # the YAML schema holds every option, with the engine's defaults
    defaults = DeploymentConfig().engine_config()
    assert defaults == EngineConfig()
    cfg = _parse(["--seed", "7", "--no-cpu-linear-kernel", "--torch-threads", "2", "--api-server-count", "2"])
    engine = cfg.engine_config()
    assert (engine.seed, engine.cpu_linear_kernel, engine.torch_threads) == (7, False, 2)
    assert cfg.server.api_server_count == 2


def test_engine_options_are_checked_in_python_too():
    from deepinfer_dp.config import EngineConfig

    with pytest.raises(ValueError, match=r"^invalid engine option\(s\): block_size: must be a power of two"):
        EngineConfig.from_kwargs(block_size=12)
    with pytest.raises(ValueError, match=r"bogus: unknown key; known: model, revision, tokenizer, dtype"):
        EngineConfig.from_kwargs(bogus=1)
    with pytest.raises(ValueError, match=r"dp_rank: must be in \[0, dp_size=2\)"):
        EngineConfig.from_kwargs(dp_size=2, dp_rank=2)
