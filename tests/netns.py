"""Several hosts on one machine: network namespaces on a bridge (``ip netns``, veth pairs).

``Hosts`` makes a server namespace holding a bridge and one namespace per worker host,
each joined to the bridge by a veth pair; nothing joins them to the machine's own
network, so the traffic of a test stays inside the namespaces it created. ``enter``
moves the calling thread into a namespace (``setns``): sockets it opens, and processes
it starts, live there. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and ``ip``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"  # private to the namespaces: the server is .1, host n is .(10 + n)
_libc = ctypes.CDLL(None, use_errno=True)


def unavailable() -> str | None:
    """Why this machine cannot build hosts out of namespaces (None: it can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tlprobe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def enter(namespace: str) -> Iterator[None]:
    """The calling thread in ``namespace`` for the block (netns is per thread)."""
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{namespace}") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class Hosts:
    """``server`` (the bridge, at SUBNET.1) and worker hosts ``h1``…``hN`` (SUBNET.11…)."""

    def __init__(self, workers: int = 2) -> None:
        self.tag = f"tl{uuid.uuid4().hex[:5]}"
        self.server = f"{self.tag}-srv"
        self.hosts = [f"{self.tag}-h{n}" for n in range(1, workers + 1)]
        self.address = f"{SUBNET}.1"
        try:
            self._build()
        except Exception:
            self.remove()
            raise

    def _build(self) -> None:
        for ns in (self.server, *self.hosts):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.server, "link", "add", "br0", "type", "bridge")
        ip("-n", self.server, "addr", "add", f"{self.address}/24", "dev", "br0")
        ip("-n", self.server, "link", "set", "br0", "up")
        for n, ns in enumerate(self.hosts, start=1):
            outer, inner = f"{self.tag}p{n}", f"{self.tag}q{n}"  # unique while in the root namespace
            ip("link", "add", outer, "netns", self.server, "type", "veth", "peer", "name", inner, "netns", ns)
            ip("-n", self.server, "link", "set", outer, "name", f"port{n}", "master", "br0", "up")
            ip("-n", ns, "link", "set", inner, "name", "eth0", "up")
            ip("-n", ns, "addr", "add", f"{self.host_address(n)}/24", "dev", "eth0")

    @staticmethod
    def host_address(n: int) -> str:
        return f"{SUBNET}.{10 + n}"

    def cut(self, n: int) -> None:
        """Host n's link down: it can no longer reach the server (nor be reached)."""
        ip("-n", self.hosts[n - 1], "link", "set", "eth0", "down")

    def mend(self, n: int) -> None:
        ip("-n", self.hosts[n - 1], "link", "set", "eth0", "up")
        ip("-n", self.hosts[n - 1], "addr", "replace", f"{self.host_address(n)}/24", "dev", "eth0")

    def pids(self, ns: str) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def remove(self) -> None:
        """Kill what still runs in the namespaces (all started by the test), then delete them."""
        for ns in (self.server, *self.hosts):
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class NamespaceRabbit:
    """A RabbitMQ node of the test's own, started inside a namespace (its own epmd and
    Erlang cookie; the machine's RabbitMQ is neither seen nor touched)."""

    def __init__(self, address: str, port: int = 5672) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tooloop-ns-rabbit-"))
        (self.folder / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {address}:{port}\nloopback_users = none\n"
        )  # guest may connect from the worker hosts: this node lives only inside the namespaces
        (self.folder / "enabled_plugins").write_text("[].\n")
        (self.folder / "env.conf").write_text("")
        env = {
            **os.environ, "HOME": str(self.folder),
            "RABBITMQ_NODENAME": "tooloop@localhost", "RABBITMQ_CONF_ENV_FILE": str(self.folder / "env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.folder / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.folder / "log"),
            "RABBITMQ_PID_FILE": str(self.folder / "pid"),
        }  # fmt: skip
        server = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
        binary = str(server) if server.exists() else shutil.which("rabbitmq-server") or "rabbitmq-server"
        self.log = self.folder / "stdout.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([binary], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        self.url = f"amqp://guest:guest@{address}:{port}//"

    def wait(self, timeout: float = 120) -> NamespaceRabbit:
        from tests.servers import amqp_answers

        deadline = time.monotonic() + timeout
        while not amqp_answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log.read_text()[-3000:]
                raise RuntimeError(f"RabbitMQ did not start in the namespace:\n{log}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
