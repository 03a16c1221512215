"""The speculative-decoding counters in Prometheus: vLLM's names, a dp_rank label, the
accepted tokens by draft position with a position label, and the drafting time."""

from prometheus_client import CollectorRegistry, generate_latest

from deepinfer_dp.metrics.rank_collector import RankStatsCollector


class FakeClient:
    def rank_stats(self) -> list[dict]:
        return [{"dp_rank": 0, "spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30,
                 "spec_decode_num_accepted_tokens": 17, "spec_decode_num_accepted_tokens_per_pos": [9, 5, 3],
                 "spec_decode_steps": 4, "spec_decode_draft_time_s": 0.5, "spec_decode_num_skipped_requests": 3},
                {"dp_rank": 1, "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                 "spec_decode_num_accepted_tokens": 0, "spec_decode_num_accepted_tokens_per_pos": [],
                 "spec_decode_steps": 0, "spec_decode_draft_time_s": 0.0, "spec_decode_num_skipped_requests": 0}]

    def health(self) -> list[dict]:
        return [{"dp_rank": 0, "up": True}, {"dp_rank": 1, "up": True}]


def test_spec_decode_counters_are_exported():
    registry = CollectorRegistry()
    registry.register(RankStatsCollector(FakeClient()))
    text = generate_latest(registry).decode()
    assert 'deepinfer:spec_decode_num_drafts_total{dp_rank="0"} 10.0' in text
    assert 'deepinfer:spec_decode_num_draft_tokens_total{dp_rank="1"} 0.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_total{dp_rank="0"} 17.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{dp_rank="0",position="2"} 3.0' in text
    assert 'deepinfer:spec_decode_steps_total{dp_rank="0"} 4.0' in text
    assert 'deepinfer:spec_decode_num_skipped_requests_total{dp_rank="0"} 3.0' in text
    assert 'deepinfer:spec_decode_draft_time_seconds_total{dp_rank="0"} 0.5' in text
    assert 'deepinfer:spec_decode_draft_time_seconds_total{dp_rank="1"} 0.0' in text
    assert 'position="0"} 9.0' in text and 'dp_rank="1",position' not in text
