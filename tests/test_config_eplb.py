"""The expert load balancing options, vLLM's names: `enable_eplb` / `eplb_config` in a YAML
config, `--enable-eplb` / `--eplb-config JSON` on the command line, both ending in
EngineConfig; a bad key or value, or the balancer without expert parallelism, is named."""

from __future__ import annotations

import argparse

import pytest

from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import ConfigError, add_config_args, load_config, load_config_file
from deepinfer_dp.eplb.config import EPLBConfig


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return parser.parse_args(argv)


def test_yaml_and_flags_reach_the_engine_config(tmp_path):
    path = tmp_path / "eplb.yaml"
    path.write_text("dp_size: 2\nenable_expert_parallel: true\nenable_eplb: true\n"
                    "eplb_config:\n  window_size: 10\n  step_interval: 20\n  num_redundant_experts: 2\n")
    engine = load_config_file(path).engine_config()
    assert engine.enable_eplb
    assert engine.eplb_config == EPLBConfig(window_size=10, step_interval=20, num_redundant_experts=2)
    flags = load_config(_parse(["--config", str(path), "--eplb-config",
                                '{"step_interval": 5, "log_balancedness": true}'])).engine_config()
    assert flags.eplb_config == EPLBConfig(step_interval=5, log_balancedness=True)
    assert not load_config(_parse([])).engine_config().enable_eplb
    assert EngineConfig().eplb_config == EPLBConfig(window_size=1000, step_interval=3000, num_redundant_experts=0)


def test_eplb_without_expert_parallelism_is_refused():
    with pytest.raises(ValueError, match="enable_eplb: needs enable_expert_parallel"):
        EngineConfig.from_kwargs(dp_size=2, enable_eplb=True)
    with pytest.raises(ValueError, match="num_redundant_experts needs enable_eplb"):
        EngineConfig.from_kwargs(dp_size=2, enable_expert_parallel=True, eplb_config={"num_redundant_experts": 2})


def test_bad_keys_and_values_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"eplb_config: num_redundant_experts: Input should be greater than or "
                                         r"equal to 0 \(got -1\)"):
        EngineConfig.from_kwargs(eplb_config={"num_redundant_experts": -1})
    with pytest.raises(ValueError, match="eplb_config: window: unknown key; known: window_size"):
        EngineConfig.from_kwargs(eplb_config={"window": 3})
    path = tmp_path / "bad.yaml"
    path.write_text("eplb_config:\n  step_interval: 0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid config: .*step_interval"):
        load_config_file(path)


def test_force_steps_parse_and_must_increase(tmp_path):
    path = tmp_path / "forced.yaml"
    path.write_text("enable_expert_parallel: true\nenable_eplb: true\neplb_config:\n  force_steps: [3, 9]\n")
    assert load_config_file(path).engine_config().eplb_config.force_steps == [3, 9]
    flags = load_config(_parse(["--eplb-config", '{"force_steps": [5]}'])).engine_config()
    assert flags.eplb_config.force_steps == [5] and EPLBConfig().force_steps == []
    with pytest.raises(ValueError, match=r"eplb_config: force_steps: must be strictly increasing \(got \[9, 3\]\)"):
        EngineConfig.from_kwargs(eplb_config={"force_steps": [9, 3]})
    with pytest.raises(ValueError, match=r"eplb_config: force_steps.0: Input should be greater than or equal to 1"):
        EngineConfig.from_kwargs(eplb_config={"force_steps": [0]})
