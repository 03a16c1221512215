"""Every deployment setting is declared once: EngineConfig (config.py) and the sections of
config_file.py. The launchers take those declarations (DPSettings, add_engine_args) instead of
declaring the options again with their own defaults, and the command lines derived from them
(`deepinfer-dp serve --help`, `launch/torchrun_generate.py --help`) agree with the YAML schema."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_dp.config import engine_fields
from deepinfer_dp.config_file import (
    SECTIONS,
    DeploymentConfig,
    DPSettings,
    RaySection,
    RouterSection,
    ServerLimits,
    ServerSection,
)

ROOT = Path(__file__).resolve().parents[1]
# Names two sections declare on purpose: server.port (--port) and metrics.port (--metrics-port);
# ray.address (--ray-address) and data_parallel.address (vLLM's --data-parallel-address).
SHARED_ON_PURPOSE = {"port": {"server", "metrics"}, "address": {"ray", "data_parallel"}}
# The modules that start a deployment from the declarations; none may declare a setting again.
LAUNCHERS = ["deepinfer_dp/cluster/dp_driver.py", "deepinfer_dp/cluster/deployment.py",
             "deepinfer_dp/cluster/ray_launcher.py",
             "deepinfer_dp/cluster/router.py", "deepinfer_dp/cluster/router_actor.py",
             "deepinfer_dp/entrypoints/llm.py", "deepinfer_dp/entrypoints/cli.py",
             "deepinfer_dp/entrypoints/openai/launcher.py", "deepinfer_dp/entrypoints/openai/api_servers.py",
             "deepinfer_dp/cluster/membership.py", "deepinfer_dp/cluster/rank_actor.py",
             "launch/torchrun_generate.py"]
# The router and Ray settings by their declared names, and the names they were passed under before.
DP_SETTINGS = {*RouterSection.model_fields, *RaySection.model_fields, "strategy", "max_restarts", "spare"}
TORCHRUN_OWN = {"-h", "--prompts-file", "--shard-sizes", "--max-tokens", "--output", "--fail-rank"}


def test_no_setting_is_declared_in_two_places():
    owners: dict[str, set[str]] = {}
    declared = {"engine": list(engine_fields(include_internal=True)),
                "deployment": ["backend"], **{s: list(m.model_fields) for s, (m, _) in SECTIONS.items()}}
    for where, names in declared.items():
        for name in names:
            owners.setdefault(name, set()).add(where)
    twice = {n: w for n, w in owners.items() if len(w) > 1 and SHARED_ON_PURPOSE.get(n) != w}
    assert not twice, f"declared in more than one place: {twice}"
    # DPSettings.of files a flat dict's key under the one section that declares it
    assert not set(RouterSection.model_fields) & set(RaySection.model_fields)
    assert set(DPSettings.model_fields) == {"router", "ray"}


def test_the_http_front_takes_the_server_sections_defaults():
    from deepinfer_dp.entrypoints.openai import draining, launcher

    section = ServerSection()
    assert (launcher.DEFAULT_HOST, launcher.DEFAULT_PORT) == (section.host, section.port)
    assert draining.DEFAULT_GRACE_S == section.shutdown_grace_s
    assert ServerLimits() == section.limits()


def _redeclarations(path: str) -> list[str]:
    """Parameters with a default value, dict keys and argparse flags named like a setting."""
    engine_flags = {"--" + name.replace("_", "-") for name in engine_fields(include_internal=True)}
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            pairs = [*zip(args.args[len(args.args) - len(args.defaults):], args.defaults, strict=True),
                     *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            # a default of None ("not given: the settings' value") declares no value
            found += [f"{node.name}({a.arg}=...)" for a, d in pairs if a.arg in DP_SETTINGS
                      and d is not None and not (isinstance(d, ast.Constant) and d.value is None)]
        elif isinstance(node, ast.Dict):
            found += [f"{{{k.value!r}: ...}}" for k in node.keys  # a rank's info has an "address" too
                      if isinstance(k, ast.Constant) and k.value in DP_SETTINGS - {"address"}]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found += [f"add_argument({a.value!r})" for a in node.args
                      if isinstance(a, ast.Constant) and a.value in engine_flags]
    return found


@pytest.mark.parametrize("path", LAUNCHERS)
def test_launchers_do_not_declare_settings_again(path):
    assert _redeclarations(path) == [], f"{path} declares deployment settings again (use DPSettings / add_engine_args)"


def test_the_check_sees_a_redeclaration(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("def start(config, policy='round_robin', host=None, *, max_rank_restarts=0, address=None):\n"
                   "    return {'strategy': 'pack'}\n"
                   "ap.add_argument('--max-num-seqs', type=int, default=256)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(_redeclarations("bad.py")) == ["add_argument('--max-num-seqs')", "start(max_rank_restarts=...)",
                                                 "start(policy=...)", "{'strategy': ...}"]


def _help(*command: str) -> dict[str, str]:
    """flag -> its help text, from a --help output (one line per option: COLUMNS is wide)."""
    env = {**os.environ, "COLUMNS": "1000"}
    out = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300, check=True).stdout
    options: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("  -"):
            invocation, _, text = line.strip().partition("  ")
            current = invocation.split(",")[0].split()[0]
            options[current] = text.strip()
        elif current is not None and line.startswith("    "):
            options[current] = (options[current] + " " + line.strip()).strip()
        else:
            current = None
    return options


def test_serve_help_torchrun_help_and_the_yaml_schema_agree():
    serve = _help("-m", "deepinfer_dp.entrypoints.cli", "serve")
    torchrun = _help("launch/torchrun_generate.py")
    schema = DeploymentConfig.model_json_schema()["properties"]
    engine = {name for name in engine_fields() if name != "dp_size"}  # torchrun's world size is its own
    assert set(torchrun) - TORCHRUN_OWN == {"--" + n.replace("_", "-") for n in engine}
    assert not (TORCHRUN_OWN - {"-h"}) & set(serve), "a torchrun-only flag is also a deployment option"
    for name in sorted(engine):
        flag = "--" + name.replace("_", "-")
        assert serve[flag] == torchrun[flag], f"{flag}: serve and torchrun_generate.py differ"
        default = schema[name].get("default")
        if default is not None:
            assert re.search(r"\(default: (.*)\)$", serve[flag]).group(1) == str(default), flag
