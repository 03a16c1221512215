"""The server's bounds as deployment config: the `server:` keys of a config file, the flags on
top, and what a bad value says."""

import argparse

import pytest

from deepinfer_dp.config_file import ConfigError, add_config_args, load_config, load_config_file
from deepinfer_dp.entrypoints.openai.admission import ServerLimits


def test_defaults_are_the_server_limits_defaults():
    args = argparse.ArgumentParser()
    add_config_args(args)
    assert load_config(args.parse_args([])).server.limits() == ServerLimits()


def test_file_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  max_n: 8\n  max_waiting_requests: 50\n  chat_special_tokens_as_text: true\n")
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["--config", str(path), "--max-n", "16", "--max-prompts", "5",
                              "--max-request-body-bytes", "4096", "--no-chat-special-tokens-as-text"])
    limits = load_config(args).server.limits()
    assert limits == ServerLimits(max_request_body_bytes=4096, max_n=16, max_prompts=5, max_waiting_requests=50,
                                  chat_special_tokens_as_text=False)


@pytest.mark.parametrize(("text", "key"), [
    ("server:\n  max_n: 0\n", "server.max_n"),
    ("server:\n  max_waiting_requests: many\n", "server.max_waiting_requests"),
    ("server:\n  max_request_body_bytes: 10\n", "server.max_request_body_bytes"),
])
def test_bad_limits_name_the_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key):
        load_config_file(path)
