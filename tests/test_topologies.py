"""Redis beyond one plain server: TLS with client certificates, Sentinel, an ACL user.

Each test starts its servers on loopback (tests/servers.py) and runs a whole run through
them, with the same URL as store and broker, as a deployment would.
"""

from __future__ import annotations

import shutil
import threading
import uuid

import pytest

from orchestrator import Status
from orchestrator.connections import ACL_COMMANDS, acl_rules
from tests.helpers import assert_done, gate, tool_run, wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


@pytest.fixture
def tls_redis():
    from tests.servers import TlsRedis

    server = TlsRedis()
    yield server
    server.stop()


def test_tls_with_client_certificates(deployment, spec, tls_redis):
    from tests.servers import wait_url

    plain = tls_redis.url.replace("rediss://", "redis://").split("?")[0]
    with pytest.raises(Exception):  # noqa: B017 - the server speaks TLS only
        wait_url(plain, timeout=0.5)
    without_cert = tls_redis.url.split("&ssl_certfile")[0]
    with pytest.raises(Exception):  # noqa: B017 - and wants a client certificate
        wait_url(without_cert, timeout=0.5)
    d = deployment(TOOLOOP_REDIS_URL=tls_redis.url)  # store, broker and result backend
    d.start_worker("-c", "2")
    handle = d.client.submit(tool_run(spec))
    assert_done(handle.wait(timeout=60))


@pytest.fixture
def sentinel_group():
    from tests.servers import SentinelGroup

    group = SentinelGroup()
    yield group
    group.stop()


def test_sentinel_primary_fails_over_mid_run(deployment, spec, sentinel_group):
    """Store and broker found through the sentinel; the primary is killed mid-run, the
    sentinel promotes the replica, and the run completes on it."""
    d = deployment(TOOLOOP_REDIS_URL=sentinel_group.url)
    d.start_worker("-c", "2")
    handle = d.client.submit(tool_run(spec, n=4, delay=0.5))
    wait_for(lambda: d.store.result(handle.run_id).iterations >= 1, timeout=30)
    old = sentinel_group.primary_port()
    sentinel_group.wait_synced()  # the replica has the run (what it lacks, a failover loses)
    sentinel_group.kill(old)
    sentinel_group.wait_primary(sentinel_group.replica, timeout=60)
    try:
        result = handle.wait(timeout=120)
    except Exception:
        raise AssertionError(f"run did not finish after the failover:\n{d.workers[0].tail()}") from None
    assert sentinel_group.primary_port() == sentinel_group.replica != old
    assert_done(result, n=4)


# -- ACL --------------------------------------------------------------------------------
@pytest.fixture
def acl_redis(tmp_path):
    """A Redis of our own whose default user is off: only the tooloop user, with
    exactly the commands of ACL_COMMANDS, on keys and channels of one prefix."""
    import redis

    from orchestrator.local import free_port
    from tests.servers import start_redis_server, wait_ping

    port, prefix, password = free_port(), f"acl-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    proc = start_redis_server(port, tmp_path)
    wait_ping(port)
    admin = redis.Redis(port=port)
    admin.execute_command("ACL", "SETUSER", "tooloop", "reset", "on", f">{password}", *acl_rules(prefix))
    admin.execute_command("ACL", "SETUSER", "admin", "on", ">admin", "~*", "&*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    admin = redis.Redis(port=port, username="admin", password="admin")
    yield prefix, f"redis://tooloop:{password}@127.0.0.1:{port}/0", admin
    proc.kill()
    proc.wait()


def test_acl_user_with_only_the_listed_commands(deployment, spec, acl_redis, holds):
    """A run with tool calls, a pause, a steer, a resume, an abort, events and listing,
    as a user limited to ACL_COMMANDS: nothing is refused (the ACL log stays empty)."""
    import redis

    prefix, url, admin = acl_redis
    with pytest.raises(redis.exceptions.NoPermissionError):  # the user really is limited
        redis.Redis.from_url(url).execute_command("FLUSHALL")
    admin.execute_command("ACL", "LOG", "RESET")
    d = deployment(TOOLOOP_REDIS_URL=url, TOOLOOP_KEY_PREFIX=prefix)
    d.start_worker("-c", "2")
    handle = d.client.submit(tool_run(spec, delay=0.3))
    wait_for(lambda: d.store.result(handle.run_id).iterations >= 1, timeout=30)
    assert handle.pause() == "ok" and handle.steer("keep going") == "ok"
    assert d.client.resume(handle.run_id) == "ok"
    assert_done(handle.wait(timeout=60))
    assert [e.type for e in handle.events(timeout=5)][-1] == "outcome"
    held = d.client.submit(spec([{"content": "never", "hold": gate(holds)}]))
    wait_for(lambda: held.status() == Status.running, timeout=30)
    assert held.abort() == "ok"
    assert {r["run_id"] for r in d.client.list(limit=5)} >= {handle.run_id, held.run_id}
    threading.Event().wait(3)  # sweeps and a catalog refresh under the same user
    denied = admin.execute_command("ACL", "LOG")
    assert denied == [], f"a command tooloop needs is not in ACL_COMMANDS: {denied}"


def test_acl_commands_are_documented():
    from pathlib import Path

    text = Path(__file__).resolve().parent.parent.joinpath("docs", "deploy.md").read_text()
    missing = [c for c in ACL_COMMANDS if f"`{c}`" not in text]
    assert not missing, f"docs/deploy.md does not list {missing}"
