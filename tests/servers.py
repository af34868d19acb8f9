"""Servers the broker/store matrix starts for itself: a RabbitMQ vhost per session, a Redis
Cluster, a TLS Redis, a sentinel over a primary and a replica. All on loopback, all owned
by the test session (the shared Redis and RabbitMQ are never reconfigured). Each server
stops with the process that started it, even when that process is killed: a crashed
pytest-xdist process leaves no servers behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from orchestrator.local import free_port, stop_with_parent

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


# -- RabbitMQ ------------------------------------------------------------------------------
def amqp_answers(url: str) -> bool:
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


class RabbitVhost:
    """A vhost of this session's own (``rabbitmqctl``), so sessions sharing the RabbitMQ
    never see each other's queues, exchanges or events. Without ``rabbitmqctl`` (a remote
    RabbitMQ), the default vhost is used: queue names still carry the session's key prefix."""

    def __init__(self, base_url: str, name: str) -> None:
        self.name, self.created = name, False
        ctl = shutil.which("rabbitmqctl")
        if ctl and _ctl(ctl, "add_vhost", name) and _ctl(ctl, "set_permissions", "-p", name,
                                                         "guest", ".*", ".*", ".*"):  # fmt: skip
            self.created = True
            self.url = base_url.rstrip("/") + "/" + quote(name, safe="")
        else:
            self.url = base_url.rstrip("/") + "//"

    def delete(self) -> None:
        ctl = shutil.which("rabbitmqctl")
        if self.created and ctl:
            _ctl(ctl, "delete_vhost", self.name)


def vhost_name(prefix: str) -> str:
    """The vhost of the test process with key prefix ``prefix``: it names the process, so that
    a later session can tell a vhost left by a killed one (see ``drop_stale_vhosts``)."""
    return f"tooloop-{prefix}-p{os.getpid()}"


def drop_stale_vhosts() -> list[str]:
    """Delete the vhosts of test processes of this machine that no longer run: a session
    killed before its clean-up leaves its quorum queues behind, each holding some of
    RabbitMQ's file handles (~3), and enough of them made RabbitMQ refuse every new
    connection (CI failed so). A vhost whose name says no process is left alone: it may be
    a live session's (`.ci/run`, which owns the machine, drops every test vhost)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return []
    listed = subprocess.run([ctl, "-q", "list_vhosts", "name"], capture_output=True, text=True, timeout=60)
    stale = []
    for name in listed.stdout.split():
        found = re.fullmatch(r"tooloop-test-[0-9a-f]+-p(\d+)", name)
        if found is not None and not Path(f"/proc/{found[1]}").exists():
            stale.append(name)
    for name in stale:
        _ctl(ctl, "delete_vhost", name)
    return stale


# Measured: a test process using RabbitMQ holds up to ~300 of its file handles at once (Celery's
# 28 delayed-delivery quorum queues and ~28 per live deployment, ~3 handles per quorum queue).
HANDLES_PER_PROCESS = 300


def check_handle_budget(processes: int) -> None:
    """Fail at once, saying why, where RabbitMQ's file-handle budget is below what ``processes``
    test processes on it need: past its budget RabbitMQ accepts no connection, and every
    worker start then times out after minutes (Debian's `ulimit -n` 1024 gives 927)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:  # a remote RabbitMQ: its budget is its operator's
        return
    done = subprocess.run([ctl, "-q", "eval", "file_handle_cache:get_limit()."],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        return
    limit, need = int(done.stdout), HANDLES_PER_PROCESS * processes
    if limit < need:
        raise RuntimeError(
            f"RabbitMQ has a budget of {limit} file handles; {processes} test processes on it need "
            f"~{need} (~3 per quorum queue). Restart it with a higher `ulimit -n` as .ci/run does, "
            "or run fewer test processes (-n)"
        )


def _ctl(ctl: str, *args: str) -> bool:
    done = subprocess.run([ctl, "-q", *args], capture_output=True, timeout=60)
    return done.returncode == 0


# -- Redis processes ---------------------------------------------------------------------
def redis_binary() -> str | None:
    return shutil.which("redis-server")


def start_redis_server(port: int, folder: Path, *extra: str) -> subprocess.Popen:
    log = folder / f"redis-{port}.log"
    return subprocess.Popen(
        [redis_binary() or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(folder), "--logfile", str(log), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=stop_with_parent,
    )  # fmt: skip


def wait_ping(port: int, timeout: float = 10, **options: object) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            if redis.Redis(port=port, socket_timeout=1, **options).ping():  # type: ignore[arg-type]
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


class _Servers:
    """Server processes by port, in a folder of their own: kill one, or stop them all."""

    folder: Path
    procs: dict[int, subprocess.Popen]

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)


class RedisCluster(_Servers):
    """``masters`` primaries (each with ``replicas`` replicas) on loopback ports."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tooloop-cluster-"))
        self.ports = [cluster_port() for _ in range(masters * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            self.create(replicas, node_timeout_ms)
        except BaseException as exc:
            logs = "\n".join(f"{f.name}: {f.read_text()[-300:]}" for f in sorted(self.folder.rglob("*.log")))
            self.stop()  # no orphaned redis-servers when the cluster never formed
            raise RuntimeError(f"the Redis Cluster did not form: {exc!r}\n{logs}") from exc
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    def create(self, replicas: int, node_timeout_ms: int) -> None:
        for port in self.ports:
            self.start_node(port, node_timeout_ms)
        for port in self.ports:
            wait_ping(port, host="127.0.0.1")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", str(replicas),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)  # fmt: skip
        self.wait_ok()
        self.wait_replicas(len(self.ports) - len(self.ports) // (1 + replicas))

    def wait_replicas(self, count: int, timeout: float = 30) -> None:
        """Until ``count`` replicas are known as such and in sync with their primary: just
        after ``--cluster create`` every node still calls itself a master for a while."""
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = redis.Redis(port=self.live_port()).cluster("nodes")
            replicas = [_port(addr) for addr, node in nodes.items() if "slave" in node["flags"]]
            links = [redis.Redis(port=p).info("replication").get("master_link_status") for p in replicas]
            synced = [link for link in links if link == "up"]
            if len(synced) == count:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{count} replicas not in sync after {timeout}s")

    def start_node(self, port: int, node_timeout_ms: int) -> None:
        folder = self.folder / str(port)  # each its own: AOF files are named alike
        folder.mkdir(exist_ok=True)
        self.procs[port] = start_redis_server(
            port, folder, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(node_timeout_ms), "--appendonly", "yes",
        )  # fmt: skip

    def info(self, port: int) -> dict[str, str]:
        out = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True,
                             text=True, timeout=5).stdout  # fmt: skip
        return dict(line.strip().split(":", 1) for line in out.splitlines() if ":" in line)

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node sees all slots served and agrees on the node count."""
        deadline = time.monotonic() + timeout
        live = [p for p, proc in self.procs.items() if proc.poll() is None]
        while time.monotonic() < deadline:
            infos = [self.info(p) for p in live]
            if all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos):
                return
            time.sleep(0.1)
        raise TimeoutError(f"cluster not ok: {infos}")

    def wait_failover(self, port: int, timeout: float = 60) -> None:
        """Until the killed primary at ``port`` is marked failed, a replica serves its
        slots, and every live node sees the cluster ok again."""
        deadline = time.monotonic() + timeout
        while port in self.masters():
            if time.monotonic() > deadline:
                raise TimeoutError(f"primary {port} still listed as a master after {timeout}s")
            time.sleep(0.1)
        self.wait_ok(timeout=max(1.0, deadline - time.monotonic()))

    def masters(self) -> list[int]:
        import redis

        nodes = redis.Redis(port=self.live_port()).cluster("nodes")
        return sorted(_port(addr) for addr, node in nodes.items()
                      if "master" in node["flags"] and "fail" not in node["flags"])  # fmt: skip

    def live_port(self) -> int:
        return next(p for p, proc in self.procs.items() if proc.poll() is None)


def _port(address: str) -> int:
    """``127.0.0.1:7000@17000`` -> 7000."""
    return int(address.split("@")[0].rsplit(":", 1)[1])


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too: Redis refuses a port
    above 55535 ("Cluster communication port is 10,000 port numbers higher")."""
    import socket

    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


# -- TLS --------------------------------------------------------------------------------
def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(cn: str, issuer: x509.Name, signer, key, ca: bool = False, usage=None, san=None):
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def write(stem: str, cert, key) -> None:
        (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("tooloop test CA", name("tooloop test CA"), ca_key, ca_key, ca=True)
    write("ca", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    write("server", issue("127.0.0.1", ca.subject, ca_key, server_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                          san=san), server_key)  # fmt: skip
    client_key = ec.generate_private_key(ec.SECP256R1())
    write("client", issue("tooloop", ca.subject, ca_key, client_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH),
          client_key)  # fmt: skip
    names = {"ca": "ca.crt", "server_cert": "server.crt", "server_key": "server.key",
             "client_cert": "client.crt", "client_key": "client.key"}  # fmt: skip
    return {role: folder / file for role, file in names.items()}


class TlsRedis:
    """A Redis that speaks only TLS and requires a client certificate signed by the test CA."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tooloop-tls-"))
        self.certs = make_certs(self.folder)
        self.port = free_port()
        c = self.certs
        self.proc = start_redis_server(
            0, self.folder, "--tls-port", str(self.port), "--tls-cert-file", str(c["server_cert"]),
            "--tls-key-file", str(c["server_key"]), "--tls-ca-cert-file", str(c["ca"]),
            "--tls-auth-clients", "yes",
        )  # fmt: skip
        self.url = (f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={c['ca']}"
                    f"&ssl_certfile={c['client_cert']}&ssl_keyfile={c['client_key']}")  # fmt: skip
        wait_url(self.url)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def wait_url(url: str, timeout: float = 10) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            if redis.Redis.from_url(url, socket_timeout=1).ping():
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


# -- Sentinel -----------------------------------------------------------------------------
class SentinelGroup(_Servers):
    """A primary, a replica and one sentinel watching them (service ``tooloop``)."""

    SERVICE = "tooloop"

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tooloop-sentinel-"))
        self.primary, self.replica, self.sentinel = free_port(), free_port(), free_port()
        self.procs = {self.primary: start_redis_server(self.primary, self.folder),
                      self.replica: start_redis_server(self.replica, self.folder, "--replicaof", "127.0.0.1",
                                                       str(self.primary))}  # fmt: skip
        conf = self.folder / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel}\nbind 127.0.0.1\ndir {self.folder}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {self.SERVICE} 5000\n"
        )  # fmt: skip
        log = str(self.folder / "sentinel.log")
        self.procs[self.sentinel] = subprocess.Popen(
            [redis_binary() or "redis-server", str(conf), "--sentinel", "--logfile", log],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=stop_with_parent)  # fmt: skip
        for port in self.procs:
            wait_ping(port)
        self.wait_primary(self.primary)
        self.wait_synced()
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel}/{self.SERVICE}/0"

    def wait_synced(self, timeout: float = 60) -> None:
        """Until the replica holds every write the primary took (its first full sync starts
        only after ``repl-diskless-sync-delay``, 5 s: a primary killed before then leaves a
        replica without the run, and the failover loses it, as Redis's asynchronous
        replication may)."""
        import redis

        primary = redis.Redis(port=self.primary_port())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if primary.execute_command("WAIT", 1, 1000) >= 1:
                return
        raise TimeoutError("the replica did not catch up with the primary")

    def primary_port(self) -> int:
        import redis

        _, port = redis.Redis(port=self.sentinel).sentinel_get_master_addr_by_name(self.SERVICE)
        return int(port)

    def wait_primary(self, port: int, timeout: float = 30) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                replicas = redis.Redis(port=self.sentinel).sentinel_slaves(self.SERVICE)
                role = redis.Redis(port=port).info("replication")["role"]
                if self.primary_port() == port and replicas and role == "master":
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"sentinel did not settle on primary {port}")


def drop_queues(url: str, keys) -> None:
    """A deployment's RabbitMQ queues, deleted when it stops: each quorum queue holds
    descriptors of RabbitMQ's, and a session's hundreds of deployments (a queue per tool
    each) exhausted them: RabbitMQ then stopped accepting connections."""
    from kombu import Connection

    import tests.tools  # noqa: F401  (the tools the workers have, hence their queues)
    import worker.builtins  # noqa: F401
    from worker.registry import REGISTRY

    names = [keys.turn_queue, keys.tool_queue, *(keys.tool_queue_of(t) for t in REGISTRY)]
    with Connection(url, connect_timeout=10) as conn:
        for name in names:
            channel = conn.channel()
            try:
                channel.queue_delete(name)
                channel.exchange_delete(name)
            except conn.channel_errors:  # never declared
                pass
            finally:
                with contextlib.suppress(*conn.channel_errors):
                    channel.close()
