"""What CURVE costs the data plane on loopback: messages/s and round-trip latency of one step's
Deltas message, plain sockets against CURVE (the default), in interleaved rounds.

The sockets are the data plane's own (cluster/data_plane.py: a PUSH to a bound PULL, the ZAP
handler admitting the sender's role, cluster/inbox.py decoding and checking each frame), in
one process over 127.0.0.1, as between a rank and the router. Throughput: one thread pushes
--messages messages as fast as it can, the receiver decodes them all. Latency: a ping-pong
through two such pairs; half the median round trip is one hop. The sides alternate every
round, so both see the same phases of a shared machine.

    python benchmarks/curve_cost.py                         # 64 requests a step, 5 rounds
    python benchmarks/curve_cost.py --requests 8 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import RANK, ROUTER, ClusterKey, DataPlane
from deepinfer_dp.cluster.inbox import Inbox
from deepinfer_dp.engine.client import TokenDelta


def deltas_message(num_requests: int) -> bytes:
    """One decode step's Deltas: a token each for `num_requests` requests."""
    deltas = [TokenDelta(f"cmpl-{i:032x}-0", [1000 + i], False, None, prompt_len=200, output_len=50, dp_rank=1)
              for i in range(num_requests)]
    return p.encoder.encode(p.Deltas(1, deltas))


class Pair:
    """A rank's PUSH to the router's inbox (and back, for the ping-pong), CURVE or plain."""

    def __init__(self, key: ClusterKey | None) -> None:
        self.router, self.rank = DataPlane(key, ROUTER), DataPlane(key, RANK)
        self.inbox = Inbox(self.router, "127.0.0.1", p.router_decoder, p.FROM_RANK_SENDERS, "bench router", RCVHWM=0)
        self.push = self.rank.connected(zmq.PUSH, self.inbox.address, ROUTER, SNDHWM=0)
        self.back = Inbox(self.rank, "127.0.0.1", p.router_decoder, {p.Deltas: (ROUTER,)}, "bench rank", RCVHWM=0)
        self.push_back = self.router.connected(zmq.PUSH, self.back.address, RANK, SNDHWM=0)
        self.push.send(deltas_message(1))  # the handshakes, before anything is timed
        self.push_back.send(deltas_message(1))
        assert self.inbox.recv() is not None and self.back.recv() is not None

    def throughput(self, raw: bytes, n: int) -> float:
        start = time.perf_counter()
        sender = threading.Thread(target=lambda: [self.push.send(raw) for _ in range(n)])
        sender.start()
        for _ in range(n):
            assert self.inbox.recv() is not None
        sender.join()
        return n / (time.perf_counter() - start)

    def round_trips(self, raw: bytes, n: int) -> list[float]:
        def echo() -> None:
            for _ in range(n):
                self.inbox.recv()
                self.push_back.send(raw)

        echoer = threading.Thread(target=echo)
        echoer.start()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.push.send(raw)
            self.back.recv()
            times.append(time.perf_counter() - start)
        echoer.join()
        return times

    def close(self) -> None:
        for s in (self.push, self.push_back):
            s.close(linger=0)
        self.inbox.close()
        self.back.close()
        self.router.close()
        self.rank.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64, help="requests in the step (deltas in the message)")
    ap.add_argument("--messages", type=int, default=20000, help="messages per throughput round")
    ap.add_argument("--pings", type=int, default=2000, help="round trips per latency round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    raw = deltas_message(args.requests)
    print(f"one Deltas message of {args.requests} requests: {len(raw)} bytes")
    pairs = {"plain": Pair(None), "curve": Pair(ClusterKey.generate())}
    rates: dict[str, list[float]] = {side: [] for side in pairs}
    hops: dict[str, list[float]] = {side: [] for side in pairs}
    try:
        for r in range(args.rounds):
            order = list(pairs) if r % 2 == 0 else list(reversed(pairs))
            for side in order:
                rates[side].append(pairs[side].throughput(raw, args.messages))
                hops[side].append(statistics.median(pairs[side].round_trips(raw, args.pings)) / 2)
            print(f"round {r}: " + ", ".join(f"{s} {rates[s][-1]:,.0f} msg/s {hops[s][-1] * 1e6:.0f} us/hop"
                                             for s in pairs))
    finally:
        for pair in pairs.values():
            pair.close()
    for side in pairs:
        print(f"{side:5s}: {statistics.median(rates[side]):,.0f} msg/s (range {min(rates[side]):,.0f}-"
              f"{max(rates[side]):,.0f}), one hop {statistics.median(hops[side]) * 1e6:.0f} us median of rounds "
              f"(range {min(hops[side]) * 1e6:.0f}-{max(hops[side]) * 1e6:.0f})")
    ratio = [c / pl for c, pl in zip(rates["curve"], rates["plain"], strict=True)]
    print(f"curve/plain throughput per round: {', '.join(f'{x:.2f}' for x in ratio)}")


if __name__ == "__main__":
    main()
