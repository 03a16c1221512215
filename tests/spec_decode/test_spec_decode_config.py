"""`speculative_config` reaches the engine the three ways every option does: a keyword of
LLM / EngineConfig, a YAML key, and a flag (a JSON object on the command line)."""

from __future__ import annotations

import argparse
import dataclasses

import pydantic
import pytest

from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import ConfigError, add_config_args, load_config, load_config_file
from deepinfer_dp.spec_decode.config import (
    DEFAULT_DISABLE_BY_ACCEPTANCE,
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return parser.parse_args(list(argv))


def test_flag_yaml_and_keyword_agree(tmp_path):
    want = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE["ngram"],
            "disable_by_acceptance": DEFAULT_DISABLE_BY_ACCEPTANCE, "model": None}
    flag = load_config(parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    path = tmp_path / "spec.yaml"
    path.write_text("speculative_config: {method: ngram, num_speculative_tokens: 3}\n")
    parsed = [flag.engine_config().speculative_config, load_config_file(path).engine_config().speculative_config,
              EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config]
    assert all(isinstance(p, SpeculativeConfig) and p.model_dump() == want for p in parsed)
    assert EngineConfig().speculative_config is None


def test_parsed_once_and_kept_through_copies():
    """The engine config holds the parsed SpeculativeConfig; a copy of the config (a rank's,
    made with dataclasses.asdict / replace) keeps it as it is instead of parsing a dict again."""
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec = config.speculative_config
    assert dataclasses.replace(config, dp_size=2).speculative_config is spec
    assert EngineConfig(**dataclasses.asdict(config)).speculative_config == spec
    with pytest.raises(pydantic.ValidationError):  # frozen: what was checked cannot change afterwards
        spec.num_speculative_tokens = 99
    with pytest.raises(ValueError, match="speculative_config: must be a mapping"):
        EngineConfig.from_kwargs(speculative_config=[3])


def test_batch_size_auto_off_defaults_per_method_unless_given():
    """n-gram drafts up to 2 requests, a draft model (K forwards of its own a step) only for
    a lone request; a value in the config, None (never off) included, is kept."""
    def batch_size(**spec):
        return EngineConfig(speculative_config={"num_speculative_tokens": 3, **spec}).speculative_config \
            .disable_by_batch_size

    assert batch_size(method="ngram") == DEFAULT_DISABLE_BY_BATCH_SIZE["ngram"] == 2
    assert batch_size(method="draft_model", model="/some/draft") == DEFAULT_DISABLE_BY_BATCH_SIZE["draft_model"] == 1
    assert batch_size(method="ngram", disable_by_batch_size=None) is None
    assert batch_size(method="draft_model", model="/some/draft", disable_by_batch_size=4) == 4


def test_bad_values_name_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("speculative_config: {method: ngram, num_speculative_tokens: 99}\n")
    with pytest.raises(ConfigError, match="bad.yaml.*num_speculative_tokens"):
        load_config_file(path)
    with pytest.raises(SystemExit):  # argparse: not JSON / not an object
        parse("--speculative-config", "{method: ngram")
    with pytest.raises(SystemExit):
        parse("--speculative-config", "[1, 2]")
