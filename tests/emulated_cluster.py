"""An emulated cluster on this one machine: one network namespace per "node", joined by a veth link
that ``tc``'s token bucket filter (tbf) can throttle, so multi-node jobs can be tested without
machines, and what crossed the "inter-node link" can be counted to the byte.

``with EmulatedCluster(rate="1gbit") as cluster:`` builds two namespaces ``<prefix>-<pid>-<seq>n0``
and ``...n1`` (``lo`` up in each) and one veth pair between them, ``veth0`` (10.77.<k>.1/24) in node 0
and ``veth1`` (10.77.<k>.2/24) in node 1. Both ends are created inside their namespaces, so nothing
is ever added to the host's own network, and no route leads out: no traffic can leave the machine.
With ``rate`` set, each end's egress goes through ``tbf rate <rate>`` (measured here: 1gbit gives
0.956 Gbit/s of TCP payload, the Ethernet/IP/TCP headers being the rest; the link unthrottled gives
about 12 Gbit/s). More than two nodes hang off a bridge in a hub namespace ``...hub``, each link
throttled at both ends.

``cluster.run(node, argv, env)`` starts a process in a node (``ip netns exec``, in its own process
group); ``kill_node`` kills every process in a node's namespace (torchrun's workers start their own
sessions, so the namespace, not the process group, says what belongs to a node); ``set_link(False)``
cuts the link; ``link_bytes()`` says what each node has sent onto it. Leaving the ``with`` block, by
an exception or Ctrl-C too, kills every process in the nodes and deletes the namespaces, which removes
the veth links. :func:`cleanup_stale` removes what a run that died without cleaning up (SIGKILL)
left; entering a cluster calls it for its prefix.

:func:`torchrun_cluster` runs ``python -m torch.distributed.run`` on every node with
``GLOO_SOCKET_IFNAME`` set to the node's veth: gloo then connects ranks by their veth addresses,
ranks of one node talk over that namespace's loopback and ranks of different nodes over the
(throttled) link. Needs root and ``ip``/``tc`` (iproute2); :func:`available` says whether this
machine can and, if not, why (tests skip with that reason).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"

#: Ports are per namespace, so any port is free in a fresh node; each job of a cluster takes the
#: next one, so a job never waits for the previous job's sockets to leave TIME_WAIT.
FIRST_PORT = 29500

_SEQ = itertools.count()
_LIVE: set[EmulatedCluster] = set()


class ClusterError(RuntimeError):
    """A command that builds, changes or removes the emulated network failed."""


def _cmd(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip()
        raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): {why}")
    return proc


def parse_rate(rate: str) -> float:
    """``tc``'s rate syntax in bits per second: ``1gbit``, ``100mbit``, ``500kbit``, ``10mibit``,
    ``125mbps`` (bytes per second); a bare number is bits per second, as for ``tc``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"not a tc rate: {rate!r}")
    number, prefix, binary, unit = m.groups()
    scale = (1024 if binary else 1000) ** " kmgt".index(prefix or " ")
    return float(number) * scale * (8 if unit == "bps" else 1)


def tbf_args(rate: str, burst: int | None = None, latency: str = "50ms") -> list[str]:
    """``tc qdisc ... tbf`` parameters for ``rate``. The default burst is 1 ms at the rate and at
    least 64 KiB (125 kB at 1gbit), a whole GSO packet of the veth (tbf splits a larger one). Measured
    here with one TCP stream: at 1gbit, bursts of 32 KiB to 1 MiB all gave 0.935-0.958 Gbit/s of
    payload; at 10gbit, 128 KiB gave 8.9 and 1.25 MB 9.5 Gbit/s. ``latency`` bounds the queue
    (rate × latency + burst bytes)."""
    if burst is None:
        burst = max(64 * 1024, int(parse_rate(rate) / 8 / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", latency]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _cmd(["ip", "netns", "pids", ns], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _empty_netns(ns: str, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> list[int]:
    """Send ``sig`` to every process in namespace ``ns`` until none is left (a process may start
    another while we kill) or ``wait_s`` passes; returns the pids still there (none, normally)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(0.05)


def _delete_netns(ns: str) -> None:
    leftover = _empty_netns(ns)
    proc = _cmd(["ip", "netns", "delete", ns], check=False)
    if proc.returncode != 0 and ns in _netns_names():
        raise ClusterError(f"could not delete namespace {ns}: {proc.stderr.strip()}")
    if leftover:
        raise ClusterError(f"processes {leftover} of namespace {ns} did not die")


def _name_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-(\d+)-\d+(?:n\d+|hub)")


def cleanup_stale(prefix: str = "zs") -> list[str]:
    """Delete the namespaces (with their links and processes) that clusters of ``prefix`` left when
    their process died without cleaning up; namespaces of a process that still lives are kept.
    Returns the names deleted."""
    removed = []
    for ns in _netns_names():
        m = _name_re(prefix).fullmatch(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_netns(ns)
            removed.append(ns)
    return removed


@functools.cache
def available() -> tuple[bool, str]:
    """Whether an :class:`EmulatedCluster` can be built here, and if not, why: Linux, root, ``ip``
    and ``tc`` found, and a namespace with a veth pair and a tbf qdisc can be created (and is
    deleted again at once)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (this process is not uid 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found"
    ns = f"zsprobe-{os.getpid()}-{next(_SEQ)}n0"
    try:
        cleanup_stale("zsprobe")
        _cmd(["ip", "netns", "add", ns], timeout=10)
        _cmd(["ip", "-n", ns, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"], timeout=10)
        _cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "probe0", "root", *tbf_args("1gbit")],
             timeout=10)
    except (ClusterError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot build a network namespace with a throttled veth link here: {e}"
    finally:
        with contextlib.suppress(ClusterError, OSError, subprocess.TimeoutExpired):
            _delete_netns(ns)
    return True, ""


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that comes while the network is taken down until it is down."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)


class EmulatedCluster:
    """``nodes`` network namespaces joined by veth links throttled to ``rate`` (a ``tc`` rate such
    as ``"1gbit"``; ``None``: unthrottled). A context manager; see the module's documentation."""

    def __init__(self, rate: str | None = "1gbit", nodes: int = 2, prefix: str = "zs",
                 burst: int | None = None, latency: str = "50ms"):
        if nodes < 2:
            raise ValueError(f"a cluster has at least 2 nodes, not {nodes}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix):
            raise ValueError(f"prefix must be a letter then letters, digits or '_': {prefix!r}")
        self.rate, self.nodes, self.prefix = rate, nodes, prefix
        self._tbf = tbf_args(rate, burst, latency) if rate else None
        self.seq = next(_SEQ)
        base = f"{prefix}-{os.getpid()}-{self.seq}"
        self.namespaces = [f"{base}n{i}" for i in range(nodes)]
        self.hub = f"{base}hub" if nodes > 2 else None
        # Each pair lives in namespaces of its own, so equal subnets of two clusters do not clash;
        # the pid still picks one, so addresses in logs tell runs apart.
        self.subnet = f"10.77.{(os.getpid() + self.seq) % 254 + 1}"
        self._procs: list[tuple[int, subprocess.Popen[Any]]] = []
        self._port = FIRST_PORT
        self._open = False

    # -- the network ------------------------------------------------------------------------------

    def addr(self, node: int) -> str:
        """The node's address on the link (its veth's)."""
        return f"{self.subnet}.{self._check(node) + 1}"

    def iface(self, node: int) -> str:
        """The name of the node's veth inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        return f"veth{self._check(node)}"

    def _ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of every veth end: the nodes' and, with a hub, the bridge ports."""
        ends = [(ns, self.iface(i)) for i, ns in enumerate(self.namespaces)]
        if self.hub:
            ends += [(self.hub, f"port{i}") for i in range(self.nodes)]
        return ends

    def _check(self, node: int) -> int:
        if not 0 <= node < self.nodes:
            raise IndexError(f"node {node} of a {self.nodes}-node cluster")
        return node

    def __enter__(self) -> EmulatedCluster:
        cleanup_stale(self.prefix)
        self._open = True
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        for ns in self.namespaces + ([self.hub] if self.hub else []):
            _cmd(["ip", "netns", "add", ns])
            _cmd(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
        if self.hub is None:  # one pair, created with each end already in its node
            _cmd(["ip", "-n", self.namespaces[0], "link", "add", "name", self.iface(0), "type", "veth",
                  "peer", "name", self.iface(1), "netns", self.namespaces[1]])
        else:  # a bridge in the hub, one pair from each node to it
            _cmd(["ip", "-n", self.hub, "link", "add", "name", "br0", "type", "bridge"])
            _cmd(["ip", "-n", self.hub, "link", "set", "dev", "br0", "up"])
            for i, ns in enumerate(self.namespaces):
                _cmd(["ip", "-n", self.hub, "link", "add", "name", f"port{i}", "type", "veth",
                      "peer", "name", self.iface(i), "netns", ns])
                _cmd(["ip", "-n", self.hub, "link", "set", "dev", f"port{i}", "master", "br0"])
        for i, ns in enumerate(self.namespaces):
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", self.iface(i)])
        for ns, dev in self._ends():
            # No IPv6 link-local address, so no neighbour discovery chatter in the byte counts.
            _cmd(["ip", "-n", ns, "link", "set", "dev", dev, "addrgenmode", "none"], check=False)
            if self._tbf:
                _cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *self._tbf])
            _cmd(["ip", "-n", ns, "link", "set", "dev", dev, "up"])

    def set_link(self, up: bool) -> None:
        """Bring every veth end up or down (a cut cable, both sides see it)."""
        for ns, dev in self._ends():
            _cmd(["ip", "-n", ns, "link", "set", "dev", dev, "up" if up else "down"])

    def link_bytes(self) -> tuple[int, ...]:
        """The bytes each node has sent onto its link so far, for two nodes ``(0→1, 1→0)``: its veth's
        ``tx_bytes``, Ethernet frames with their headers (a segmentation-offload packet of up to
        64 KiB is counted with one set of headers). Subtract two readings."""
        counts = []
        for i, ns in enumerate(self.namespaces):
            out = _cmd(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{self.iface(i)}/statistics/tx_bytes"])
            counts.append(int(out.stdout))
        return tuple(counts)

    # -- processes --------------------------------------------------------------------------------

    def run(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None,
            **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``node``'s namespace, in a process group of its own; ``env`` is its
        whole environment (``None``: this process's)."""
        if not self._open:
            raise RuntimeError("the cluster is not running (use it as a context manager)")
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[self._check(node)], *argv],
                                env=env, start_new_session=True, **popen_kwargs)
        self._procs.append((node, proc))
        return proc

    def next_port(self) -> int:
        """A port no earlier job of this cluster used (every port of a fresh node is free)."""
        self._port += 1
        return self._port - 1

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process started on ``node``: the process groups :meth:`run` started,
        then whatever else is in the namespace (torchrun's workers have sessions of their own), until
        nothing is left; reaps what :meth:`run` started. ``sig`` other than SIGKILL is sent once,
        to the groups and the namespace, and nothing waits."""
        ns = self.namespaces[self._check(node)]
        for n, proc in self._procs:
            if n == node and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        if sig != signal.SIGKILL:
            for pid in _netns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            return
        leftover = _empty_netns(ns)
        if leftover:
            raise ClusterError(f"processes {leftover} in node {node} did not die")
        for n, proc in self._procs:
            if n == node:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)

    # -- teardown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the nodes, delete the namespaces (and with them the links). Safe to
        call twice; a Ctrl-C meanwhile is held until it is done."""
        if not self._open:
            return
        with _sigint_deferred():
            errors = []
            existing = set(_netns_names())
            for ns in self.namespaces + ([self.hub] if self.hub else []):
                if ns in existing:
                    try:
                        _delete_netns(ns)
                    except (ClusterError, OSError, subprocess.TimeoutExpired) as e:
                        errors.append(str(e))
            for _, proc in self._procs:  # no zombie children either
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            self._open = False
            _LIVE.discard(self)
            if errors:
                raise ClusterError("; ".join(errors))

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmulatedCluster({self.namespaces}, rate={self.rate!r}, subnet={self.subnet}.0/24)"


def cluster_fixture(rate: str | None = "1gbit", nodes: int = 2, prefix: str = "zs", scope: Any = "function") -> Any:
    """A pytest fixture that yields an entered :class:`EmulatedCluster` and takes it down after the
    test (or module, ...: ``scope``), or skips the test with :func:`available`'s reason. Assign it in
    a test module: ``cluster = cluster_fixture("100mbit")``, then ``def test_x(cluster): ...``."""
    import pytest  # only for tests; benchmarks import this module without it

    @pytest.fixture(scope=scope)
    def fixture() -> Iterator[EmulatedCluster]:
        ok, why = available()
        if not ok:
            pytest.skip(why)
        with EmulatedCluster(rate, nodes, prefix) as cluster:
            yield cluster

    return fixture


@atexit.register
def _close_all() -> None:  # a cluster entered but never left (the interpreter exits from inside it)
    for cluster in list(_LIVE):
        with contextlib.suppress(Exception):
            cluster.close()


# -- torchrun on every node -------------------------------------------------------------------------


@dataclasses.dataclass
class NodeResult:
    returncode: int | None  # negative: killed by that signal (at the deadline: see ClusterRun.timed_out)
    stdout: str
    stderr: str


@dataclasses.dataclass
class ClusterRun:
    nodes: list[NodeResult]
    bytes_before: tuple[int, ...]  # EmulatedCluster.link_bytes() at the start and at the end
    bytes_after: tuple[int, ...]
    seconds: float
    timed_out: bool

    @property
    def link_delta(self) -> tuple[int, ...]:
        """What each node sent onto the link during the job."""
        return tuple(a - b for a, b in zip(self.bytes_after, self.bytes_before))

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(n.returncode == 0 for n in self.nodes)

    def describe(self) -> str:
        """Every node's exit status and output, for an assertion message."""
        return "\n".join(f"--- node {i}: returncode {n.returncode}{' (timed out)' if self.timed_out else ''}\n"
                         f"stdout:\n{n.stdout}\nstderr:\n{n.stderr}" for i, n in enumerate(self.nodes))


def node_env(cluster: EmulatedCluster, node: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` over it, ``src/`` and ``tests/`` first on
    ``PYTHONPATH``, gloo on the node's veth and one OpenMP thread unless ``env`` says otherwise."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), str(TESTS), full.get("PYTHONPATH", "")) if p)
    full["GLOO_SOCKET_IFNAME"] = cluster.iface(node)
    return full


class TorchrunJob:
    """torchrun started on every node (:func:`start_torchrun`); :meth:`wait` collects it."""

    def __init__(self, cluster: EmulatedCluster, procs: list[subprocess.Popen[Any]],
                 logdir: tempfile.TemporaryDirectory[str], bytes_before: tuple[int, ...]):
        self.cluster, self.procs, self._logdir, self.bytes_before = cluster, procs, logdir, bytes_before
        self.started = time.monotonic()

    def wait(self, timeout: float) -> ClusterRun:
        """Wait until every node's torchrun exits, or ``timeout`` seconds from the start, then kill
        every node that still runs (``timed_out``)."""
        deadline = self.started + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        timed_out = any(p.poll() is None for p in self.procs)
        for node, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.cluster.kill_node(node)
        seconds = time.monotonic() - self.started
        after = self.cluster.link_bytes()
        logs = Path(self._logdir.name)
        nodes = [NodeResult(p.returncode, (logs / f"node{i}.out").read_text(errors="replace"),
                            (logs / f"node{i}.err").read_text(errors="replace")) for i, p in enumerate(self.procs)]
        self._logdir.cleanup()
        return ClusterRun(nodes, self.bytes_before, after, seconds, timed_out)


def start_torchrun(cluster: EmulatedCluster, script: str | os.PathLike[str], args: Sequence[str] = (),
                   nproc_per_node: int = 2, env: dict[str, str] | None = None, rdzv: str = "static",
                   extra: Sequence[str] = ()) -> TorchrunJob:
    """Start ``python -m torch.distributed.run ... script args`` on every node of ``cluster``.

    ``rdzv="static"`` (the default): node 0's torchrun hosts the store at ``addr(0)``, ranks are
    ``node * nproc_per_node + local rank``. ``rdzv="c10d"``: the c10d rendezvous at ``addr(0)``; node
    0 is told it hosts it (``is_host``), since torch guesses that from the host name, which resolves
    to an address outside the namespaces. ``extra``: more torchrun options."""
    port = cluster.next_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes),
                "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", *extra]
    logdir = tempfile.TemporaryDirectory(prefix="zs-cluster-")
    before = cluster.link_bytes()
    procs = []
    for node in range(cluster.nodes):
        if rdzv == "static":
            where = ["--node-rank", str(node), "--master-addr", cluster.addr(0), "--master-port", str(port)]
        elif rdzv == "c10d":
            where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addr(0)}:{port}",
                     "--rdzv-id", f"{cluster.namespaces[0]}-{port}", "--local-addr", cluster.addr(node),
                     "--rdzv-conf", f"is_host={int(node == 0)}"]
        else:
            raise ValueError(f"rdzv must be 'static' or 'c10d', not {rdzv!r}")
        with open(Path(logdir.name) / f"node{node}.out", "wb") as out, \
                open(Path(logdir.name) / f"node{node}.err", "wb") as err:
            procs.append(cluster.run(node, [*launcher, *where, str(script), *args], node_env(cluster, node, env),
                                     stdout=out, stderr=err))
    return TorchrunJob(cluster, procs, logdir, before)


def torchrun_cluster(cluster: EmulatedCluster, script: str | os.PathLike[str], args: Sequence[str] = (),
                     nproc_per_node: int = 2, env: dict[str, str] | None = None, timeout: float = 180,
                     rdzv: str = "static", extra: Sequence[str] = ()) -> ClusterRun:
    """Run ``script`` with torchrun on every node of ``cluster`` (:func:`start_torchrun`) and wait
    for it (:meth:`TorchrunJob.wait`): every node's exit status and output, the link's byte counts
    before and after."""
    return start_torchrun(cluster, script, args, nproc_per_node, env, rdzv, extra).wait(timeout)
