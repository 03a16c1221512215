"""A multi-node Ray cluster on one machine: each node in a Linux network namespace of its own,
with its own address on a private bridge, Ray's token authentication on.

Layout of cluster `ID` (every name starts with `dinf-`, so a leftover is easy to find):
  dinf-ID-net    holds the bridge `br0` and nothing else (no address, no route out)
  dinf-ID-head   10.213.0.1: the Ray head (GCS); what runs on the head (serve) runs here
  dinf-ID-w1 ... 10.213.0.2, ...: Ray worker nodes
  more namespaces on the bridge on demand (add_host), e.g. an outsider without keys
Each node namespace has its loopback up and one veth into the bridge; no namespace has a
default route, so nothing here can send to an address the cluster did not make. Ray's state,
the token (mode 600) and logs live under /tmp/dinf-ID. down() kills every process inside the
namespaces by PID (`ip netns pids`) and deletes the namespaces, which deletes their links.

Used by the tests (the `netns_cluster` fixture) and by launch/netns_cluster.sh:
  python tests/netns_utils.py up ID [WORKERS]  /  down ID  /  leftovers
Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "dinf-"
SUBNET = "10.213.0"
RAY_PORT = 6379
CLONE_NEWNET = 0x40000000
BIN = Path(sys.executable).parent


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`, its output captured (tests/loopback_netns.py uses it too)."""
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def namespaces() -> list[str]:
    """Every network namespace whose name starts with dinf- (anyone's)."""
    out = ip("netns", "list").stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(PREFIX))


def netns_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False).stdout
    return [int(pid) for pid in out.split()]


def leftover_processes(cluster_dir: Path) -> list[str]:
    """Processes whose command line names `cluster_dir` (Ray's processes of a cluster name
    their session directory under it), as 'pid name'."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        if any(str(cluster_dir) in arg for arg in proc.info["cmdline"] or ()):
            found.append(f"{proc.info['pid']} {proc.info['name']}")
    return found


def leftovers(cluster_ids: list[str], root: Path = Path("/tmp")) -> list[str]:
    """What is left of these clusters: namespaces, processes naming their directory, the
    directories themselves."""
    found = []
    for cid in cluster_ids:
        cluster = NetnsCluster(cid, root=root)
        found += [f"namespace {ns}" for ns in namespaces() if ns.startswith(cluster.ns(""))]
        found += [f"process {p}" for p in leftover_processes(cluster.dir)]
        found += [f"directory {cluster.dir}"] if cluster.dir.exists() else []
    return found


def in_netns(ns: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args) on a thread that entered namespace `ns`: the sockets it opens live there (an
    HTTP client on the bridge, without giving this process's own namespace a link to it).
    setns changes only the calling thread's namespace."""
    result: dict[str, Any] = {}

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {ns}")
        finally:
            os.close(fd)
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name=f"in-{ns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


@dataclasses.dataclass
class Node:
    name: str  # head, w1, w2, ... (the short name; the namespace is dinf-ID-name)
    address: str
    num_cpus: int = 0
    ray: bool = True  # a Ray node (False: a bare host on the bridge)


class NetnsCluster:
    """A Ray head and `workers` worker nodes, each in its own namespace. The head has no CPUs
    for Ray unless `head_cpus` says so: ranks go to the workers, the router (no CPU reserved) to
    the head. Every Ray node gets the resource `node:<name>` (1)."""

    def __init__(self, cluster_id: str, workers: int = 2, head_cpus: int = 0, worker_cpus: int = 1,
                 root: Path = Path("/tmp")) -> None:
        self.id = cluster_id
        self.dir = root / f"{PREFIX}{cluster_id}"
        self.token_path = self.dir / "token"
        self.nodes = {"head": Node("head", f"{SUBNET}.1", head_cpus)}
        for i in range(1, workers + 1):
            self.nodes[f"w{i}"] = Node(f"w{i}", f"{SUBNET}.{i + 1}", worker_cpus)
        self._bridge = self.ns("net")

    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def ns(self, name: str) -> str:
        return f"{PREFIX}{self.id}-{name}"

    def env(self) -> dict[str, str]:
        """What a Ray client of this cluster needs: token auth on, with this cluster's token. Not
        the single-node switch a private loopback instance of the same test session set in
        os.environ (ray_launcher._loopback_only): under it `ray start` on a worker node refuses
        to join ("Multi-node Ray clusters are not supported on Windows and OSX")."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                "RAY_USAGE_STATS_ENABLED": "0"}

    # ---- network ------------------------------------------------------------------------
    def up(self, timeout_s: float = 120.0, ray: bool = True) -> NetnsCluster:
        """Makes the namespaces and starts Ray on every node (`ray`: False, the network only);
        on any failure tears down first."""
        try:
            self.dir.mkdir(parents=True, exist_ok=False)
            self.token_path.write_text(secrets.token_hex(32))
            self.token_path.chmod(0o600)
            ip("netns", "add", self._bridge)
            ip("-n", self._bridge, "link", "set", "lo", "up")
            ip("-n", self._bridge, "link", "add", "br0", "type", "bridge")
            ip("-n", self._bridge, "link", "set", "br0", "up")
            for node in self.nodes.values():
                self._attach(node)
            if not ray:
                return self
            self.start_ray("head")
            for name in self.nodes:
                if name != "head":
                    self.start_ray(name)
            self.wait_for_nodes(len(self.nodes), timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def add_host(self, name: str, octet: int) -> Node:
        """One more namespace on the bridge, with no Ray (an outsider, a client)."""
        node = Node(name, f"{SUBNET}.{octet}", ray=False)
        self.nodes[name] = node
        self._attach(node)
        return node

    def _attach(self, node: Node) -> None:
        ns, port = self.ns(node.name), f"p-{node.name}"
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self._bridge)
        ip("-n", ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", self._bridge, "link", "set", port, "master", "br0")
        ip("-n", self._bridge, "link", "set", port, "up")

    def set_link(self, name: str, up: bool) -> None:
        """Cuts (or restores) node `name` off the bridge, its processes left running."""
        ip("-n", self._bridge, "link", "set", f"p-{name}", "up" if up else "down")

    # ---- processes ----------------------------------------------------------------------
    def popen(self, name: str, argv: list[str], log: Path | None = None, **kwargs: Any) -> subprocess.Popen:
        """argv inside node `name`'s namespace, in a session of its own, with the cluster's env."""
        out = open(log, "a") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            return subprocess.Popen(["ip", "netns", "exec", self.ns(name), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=kwargs.pop("env", self.env()), **kwargs)
        finally:
            if log is not None:
                out.close()

    def start_ray(self, name: str) -> None:
        node = self.nodes[name]
        common = ["--node-ip-address", node.address, "--num-cpus", str(node.num_cpus),
                  "--resources", json.dumps({f"node:{name}": 1}), "--temp-dir", str(self.dir / f"ray-{name}"),
                  "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
        where = (["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"] if name == "head"
                 else ["--address", self.ray_address])
        log = self.dir / f"ray-start-{name}.log"
        # Ray's workers start at nice 15 by default: ranks are the work itself (as ensure_ray's
        # private instance does).
        env = {**self.env(), "RAY_worker_niceness": "0"}
        proc = self.popen(name, [str(BIN / "ray"), "start", *where, *common], log=log, env=env)
        if proc.wait(timeout=180) != 0:
            raise RuntimeError(f"ray start on {name} failed: {log.read_text()[-3000:]}")

    def wait_for_nodes(self, count: int, timeout_s: float) -> None:
        """Until the head's GCS lists `count` live nodes (asked from inside the head)."""
        script = ("import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                  "print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.monotonic() + timeout_s
        while True:
            out = subprocess.run(["ip", "netns", "exec", self.ns("head"), sys.executable, "-c", script,
                                  self.ray_address], capture_output=True, text=True, env=self.env(), timeout=timeout_s)
            lines = out.stdout.split()
            if out.returncode == 0 and lines and int(lines[-1]) >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} Ray nodes did not come up: {out.stdout[-500:]} {out.stderr[-2000:]}")
            time.sleep(1.0)

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL to every process in node `name`'s namespace (a machine that lost power: its
        Ray raylet and workers, and whatever ran there); returns their PIDs."""
        pids = netns_pids(self.ns(name))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def down(self) -> None:
        """Kills every process in the cluster's namespaces and deletes them (their links go with
        them) and the cluster's directory. Safe to call twice, or on a half-made cluster."""
        mine = [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{self.id}-")]
        for _ in range(50):  # a fork in flight can still land after a round of kills
            alive = [pid for ns in mine for pid in netns_pids(ns)]
            if not alive:
                break
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        alive = [pid for ns in mine for pid in netns_pids(ns)]
        for ns in mine:
            ip("netns", "delete", ns, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        if alive:
            raise RuntimeError(f"processes {alive} of cluster {self.id} outlived 5 s of SIGKILL")


def _main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "up":
        cluster = NetnsCluster(argv[1], workers=int(argv[2]) if len(argv) > 2 else 2).up()
        for node in cluster.nodes.values():
            print(f"{cluster.ns(node.name)} {node.address}")
        print(f"RAY_ADDRESS={cluster.ray_address} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.token_path}")
        return 0
    if len(argv) == 2 and argv[0] == "down":
        NetnsCluster(argv[1]).down()
        return 0
    if argv == ["leftovers"]:
        print("\n".join(namespaces()))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
