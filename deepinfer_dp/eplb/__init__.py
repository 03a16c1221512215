"""Expert-parallel load balancing (EPLB): redundant expert slots, a placement that balances
the ranks' load, and moving experts between ranks in lockstep while serving.

config.py      EPLBConfig, the `eplb_config` option (vLLM's keys).
policy.py      the placement policy: replicate hot experts, pack replicas into ranks.
rebalancer.py  the per-model balancer: the sliding window of expert loads, when to
               rebalance, moving weights over the EP group layer by layer, the counters.

The map from a router's logical expert to a physical slot is the MoE layer's own
(layers/expert_map.py).
"""
