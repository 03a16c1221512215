"""Expert load balancing in /metrics: the balancer's rank_stats() keys become Prometheus
series (balancedness per layer and overall, rebalances, bytes moved, time moving, the
logical expert of each physical slot), ranks without a balancer export none of them, and
the Grafana EPLB panels' queries name exported series and are valid PromQL (promtool)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deepinfer_dp.metrics.rank_collector import RankStatsCollector

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"


def _rank(dp_rank: int, first: int, end: int) -> dict:
    return {"dp_rank": dp_rank, "moe_layers": [0, 2], "moe_local_experts": [first, end],
            "moe_expert_tokens": [[1] * 10, [2] * 10], "moe_collective_s": 0.5, "moe_collective_share": 0.1,
            "eplb_rebalances": 3, "eplb_balancedness": 0.9, "eplb_balancedness_per_layer": [0.85, 0.95],
            "eplb_moved_bytes": 1024 * (dp_rank + 1), "eplb_move_s": 0.25,
            "eplb_placement": [[4, 6, 2, 3, 0, 1, 2, 7, 3, 5], [0, 5, 2, 3, 7, 6, 2, 3, 1, 4]]}


class _Client:
    def __init__(self, stats: list[dict]) -> None:
        self.stats = stats

    def rank_stats(self) -> list[dict]:
        return self.stats

    def health(self) -> list[dict]:
        return [{"dp_rank": s["dp_rank"], "up": True} for s in self.stats]


def _scrape(stats: list[dict]) -> str:
    registry = CollectorRegistry()
    registry.register(RankStatsCollector(_Client(stats)))
    return generate_latest(registry).decode()


def _series(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels))): float(value)
            for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M)}


def test_balancer_stats_become_series():
    text = _scrape([_rank(0, 0, 5), _rank(1, 5, 10)])
    assert _series(text, "deepinfer:eplb_balancedness")[(("dp_rank", "1"),)] == 0.9
    layers = _series(text, "deepinfer:eplb_layer_balancedness")
    assert layers[(("dp_rank", "0"), ("layer", "2"))] == 0.95 and len(layers) == 4
    assert _series(text, "deepinfer:eplb_rebalances_total")[(("dp_rank", "0"),)] == 3
    assert _series(text, "deepinfer:eplb_moved_bytes_total")[(("dp_rank", "1"),)] == 2048
    assert _series(text, "deepinfer:eplb_move_time_seconds_total")[(("dp_rank", "0"),)] == 0.25
    slots = _series(text, "deepinfer:eplb_slot_expert")
    assert len(slots) == 20  # each rank its own 5 slots of 2 layers
    assert slots[(("dp_rank", "1"), ("layer", "2"), ("slot", "9"))] == 4
    tokens = _series(text, "deepinfer:moe_expert_tokens_total")
    assert {int(dict(k)["expert"]) for k in tokens if dict(k)["dp_rank"] == "1"} == set(range(5, 10))


def test_no_balancedness_before_the_first_rebalance_and_no_series_without_a_balancer():
    first = {**_rank(0, 0, 5), "eplb_balancedness": None, "eplb_balancedness_per_layer": None}
    text = _scrape([first])
    assert not _series(text, "deepinfer:eplb_balancedness")
    assert _series(text, "deepinfer:eplb_rebalances_total")[(("dp_rank", "0"),)] == 3
    plain = {k: v for k, v in _rank(0, 0, 5).items() if not k.startswith("eplb_")}
    assert "deepinfer:eplb_" not in _scrape([plain])


def _eplb_exprs() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "deepinfer:eplb_" in t["expr"]]


def test_grafana_panels_name_exported_series():
    text = _scrape([_rank(0, 0, 5), _rank(1, 5, 10)])
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    names = {n for e in _eplb_exprs() for n in re.findall(r"deepinfer:[A-Za-z0-9_:]+", e)}
    assert len(names) >= 4 and names <= exported


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Prometheus is not installed")
def test_eplb_panel_queries_are_valid_promql(tmp_path):
    rules = {"groups": [{"name": "eplb", "rules": [{"record": f"eplb:check{i}", "expr": e}
                                                   for i, e in enumerate(_eplb_exprs())]}]}
    path = tmp_path / "eplb_rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
