"""Where the server's API key comes from, kept off every command line.

`--api-key KEY` shows in /proc/PID/cmdline, which every local user can read; a file
(`--api-key-file PATH`, its first line) or the environment variable DEEPINFER_DP_API_KEY (as
vLLM reads VLLM_API_KEY) do not. A key given on the command line or in a file wins over the
environment. The variable is removed from this process's environment once read, so that the
processes started after (Ray's, the ranks, the router) never hold it; extra API server
processes get the key through multiprocessing's pipe (entrypoints/openai/api_servers.py).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

ENV_VAR = "DEEPINFER_DP_API_KEY"


def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ: MutableMapping[str, str] = os.environ) -> str | None:
    """The key to require on /v1, or None; raises ValueError naming the source at fault."""
    from_env = environ.pop(ENV_VAR, None)
    if api_key is not None and api_key_file is not None:
        raise ValueError("give the API key one way: --api-key or --api-key-file, not both")
    if api_key_file is not None:
        key, source = _read_key_file(Path(api_key_file)), f"--api-key-file {api_key_file}"
    elif api_key is not None:
        key, source = api_key, "--api-key"
    elif from_env is not None:
        key, source = from_env, f"the environment variable {ENV_VAR}"
    else:
        return None
    if not key.strip():
        raise ValueError(f"the API key from {source} is empty")
    return key


def _read_key_file(path: Path) -> str:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"--api-key-file: no such file: {path}") from None
    except OSError as e:
        raise ValueError(f"--api-key-file: cannot read {path}: {e.strerror}") from None
    lines = text.splitlines()
    return lines[0].strip() if lines else ""
