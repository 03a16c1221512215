"""The API key off the command line (entrypoints/openai/api_key.py): from DEEPINFER_DP_API_KEY
or --api-key-file, with --api-key still accepted; `serve --api-server-count 2` started with the
variable requires the key on every API server, and no process it starts holds the key on its
command line or in its environment."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import psutil
import pytest
from server_utils import serve_command, stop_serve_command, tiny_model_dir

from deepinfer_dp.entrypoints.openai.api_key import ENV_VAR, resolve_api_key

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-from-the-environment-5a1f"


def test_sources_and_precedence(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")
    env = {ENV_VAR: "from-env"}
    assert resolve_api_key(None, str(key_file), env) == "from-file"
    assert env == {}  # read once and gone: no process started later inherits it
    assert resolve_api_key("from-flag", None, {ENV_VAR: "from-env"}) == "from-flag"
    assert resolve_api_key(None, None, {ENV_VAR: "from-env"}) == "from-env"
    assert resolve_api_key(None, None, {}) is None


@pytest.mark.parametrize("api_key, api_key_file, env, message", [
    ("a", "some-file", {}, "not both"),
    (None, "/nonexistent/key", {}, "no such file: /nonexistent/key"),
    (None, None, {ENV_VAR: " "}, f"from the environment variable {ENV_VAR} is empty"),
    ("", None, {}, "from --api-key is empty"),
])
def test_refusals_name_the_source(api_key, api_key_file, env, message):
    with pytest.raises(ValueError, match=message):
        resolve_api_key(api_key, api_key_file, env)


def test_empty_key_file_is_refused(tmp_path):
    (tmp_path / "key").write_text("")
    with pytest.raises(ValueError, match="--api-key-file .* is empty"):
        resolve_api_key(None, str(tmp_path / "key"), {})


def _requires(url: str, key: str) -> None:
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200


def test_key_file_serves(tmp_path):
    model = tiny_model_dir(tmp_path / "models")
    (tmp_path / "key").write_text("k3y-from-a-file\n")
    proc, url = serve_command("--config", str(ROOT / "configs" / "tiny_test.yaml"), "--model", model,
                              "--dp-size", "1", "--kv-cache-memory-gb", "0.02", "--api-key-file", str(tmp_path / "key"))
    try:
        _requires(url, "k3y-from-a-file")
        assert "k3y-from-a-file" not in " ".join(psutil.Process(proc.pid).cmdline())
    finally:
        code = stop_serve_command(proc)
    assert code == 0, proc.stderr.read()[-3000:]


@pytest.mark.slow
def test_key_from_the_environment_reaches_api_servers_and_no_child_holds_it(tmp_path):
    model = tiny_model_dir(tmp_path / "models")
    proc, url = serve_command("--config", str(ROOT / "configs" / "tiny_test.yaml"), "--model", model,
                              "--dp-size", "1", "--api-server-count", "2", "--kv-cache-memory-gb", "0.02",
                              env={ENV_VAR: KEY, "RAY_AUTH_MODE": "disabled"})
    try:
        for _ in range(4):  # new connections: the kernel spreads them over both API servers
            _requires(url, KEY)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # two API servers and at least Ray's processes
        for child in children:
            with child.oneshot():
                try:
                    cmdline, environ = " ".join(child.cmdline()), child.environ()
                except psutil.NoSuchProcess:
                    continue
            assert KEY not in cmdline, cmdline
            assert ENV_VAR not in environ and KEY not in environ.values(), cmdline
    finally:
        code = stop_serve_command(proc)
    assert code == 0, proc.stderr.read()[-3000:]
    assert os.environ.get(ENV_VAR) is None  # (the test's own environment was never touched)
