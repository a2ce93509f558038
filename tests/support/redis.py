"""Real ``redis-server`` processes for tests: one server, or a three-master Redis Cluster.

Each server listens on 127.0.0.1 on a free port, keeps its files in its own temporary directory
and persists nothing (``--save ""``, ``--appendonly no``), so tests can kill, pause, restart and
inspect it without touching the shared Redis on 6379. A missing binary is an error that says how
to install it: CI must run the Redis suites, never skip them.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import redis

from tests.support.procs import free_port

INSTALL_HINT = "install it with `apt-get install -y redis-server` (it ships redis-server and redis-cli)"


class RedisNotInstalled(RuntimeError):
    """``redis-server`` or ``redis-cli`` is not on PATH."""


def require_binary(name: str) -> str:
    """The path of ``name`` on PATH; raises ``RedisNotInstalled`` naming how to install it."""
    path = shutil.which(name)
    if path is None:
        raise RedisNotInstalled(f"`{name}` not found on PATH: {INSTALL_HINT}. The Redis tests need it.")
    return path


class PortTaken(RuntimeError):
    """The server could not bind its port: someone took it after we chose it."""


class RedisServer:
    """One ``redis-server`` child process on 127.0.0.1; ``start`` again reuses the same port."""

    def __init__(
        self,
        port: int | None = None,
        *,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        name: str = "redis",
    ) -> None:
        self.binary = require_binary("redis-server")
        self._pick_ports = port is None
        self.port = port if port is not None else free_port()
        self.cluster = cluster
        # The cluster bus port defaults to port + 10000, which may be taken or out of range.
        self.bus_port = free_port() if cluster else None
        self.extra_args = tuple(extra_args)
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"sluice-{name}-"))
        self.log_path = self.dir / "redis.log"
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self._popen is not None, "not started"
        return self._popen.pid

    def args(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.log_path),
            *self.cluster_args(),
            *self.extra_args,
        ]

    def cluster_args(self) -> list[str]:
        if self.bus_port is None:
            return []
        return [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
            "--cluster-port",
            str(self.bus_port),
        ]

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        """Start the process and wait until it answers PING; raises with its log otherwise.

        A free port can be taken by someone else between choosing it and binding it; on a first
        start with ports this object chose, it chooses new ones and tries again.
        """
        for _ in range(5):
            try:
                return self._start_once(timeout_s)
            except PortTaken:
                if not self._pick_ports:
                    raise
                self.port = free_port()
                self.bus_port = free_port() if self.cluster else None
        return self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> RedisServer:
        self.log_path.unlink(missing_ok=True)
        self._popen = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                log = self.log()
                error = PortTaken if "Address already in use" in log else RuntimeError
                raise error(f"{self.name} exited with {self._popen.returncode}:\n{log}")
            with contextlib.suppress(redis.exceptions.RedisError), self.client(timeout_s=0.5) as client:
                if client.ping():
                    self._pick_ports = False  # from now on, restarts keep the port
                    return self
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"{self.name} not answering on port {self.port} after {timeout_s}s:\n{self.log()}")

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        """A synchronous client to inspect or drive the server (close it after use)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else "(no log)"

    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown work; the port is free again once this returns."""
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        self._signal_and_wait(signal.SIGTERM)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets open and answers nothing (a hung Redis)."""
        if self._popen is not None:
            self._popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._popen is not None:
            self._popen.send_signal(signal.SIGCONT)

    def cleanup(self) -> None:
        """Stop the process and remove its directory."""
        self.resume()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _signal_and_wait(self, sig: int) -> None:
        if self._popen is None or self._popen.poll() is not None:
            return
        self._popen.send_signal(signal.SIGCONT)
        self._popen.send_signal(sig)
        try:
            self._popen.wait(10)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait(10)


@contextlib.contextmanager
def redis_server(*, extra_args: Sequence[str] = (), name: str = "redis") -> Iterator[RedisServer]:
    """A started ``RedisServer`` on a free port, stopped and removed on exit."""
    server = RedisServer(extra_args=extra_args, name=name)
    try:
        yield server.start()
    finally:
        server.cleanup()


class RedisClusterNodes:
    """Three (or more) cluster-enabled servers joined by ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.cli = require_binary("redis-cli")
        self.nodes = [RedisServer(cluster=True, name=f"redis-cluster-{i}") for i in range(masters)]

    @property
    def url(self) -> str:
        """Any node's URL; a cluster client discovers the rest."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        created = subprocess.run(
            [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
        self._wait_ok(timeout_s)
        return self

    def _wait_ok(self, timeout_s: float) -> None:
        """Wait until every node reports ``cluster_state:ok`` and knows all masters."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._node_ok(node) for node in self.nodes):
                return
            time.sleep(0.05)
        raise TimeoutError(f"cluster not ok after {timeout_s}s:\n" + "\n".join(n.log() for n in self.nodes))

    def _node_ok(self, node: RedisServer) -> bool:
        with node.client() as client:
            info = client.cluster("INFO")
        # redis-py parses the reply into a dict of strings.
        return bool(
            info.get("cluster_state") == "ok" and str(info.get("cluster_known_nodes")) == str(len(self.nodes))
        )

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[RedisClusterNodes]:
    """A started, joined cluster of ``masters`` primaries, stopped and removed on exit."""
    cluster = RedisClusterNodes(masters)
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()
