"""Many worker hosts: three hosts built on this machine out of network namespaces.

A server namespace runs Redis (the store) and RabbitMQ (the broker), both of the test's
own, and the scripted model; two host namespaces run a worker each, joined to the server
by veth pairs on a bridge (tests/netns.py). Nothing joins the namespaces to the machine's
network: the traffic stays inside the namespaces the test created. Each host has its own
sandbox root, so a tool's record says which host ran it, and the model's replies say which
host called it (the scripted model sees the caller's address).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import Status
from orchestrator.local import WorkerProcess
from tests import netns
from tests.helpers import call, tools, wait_for

RUNS = 50
MODEL_PORT, REDIS_PORT = 8080, 6379  # in the server namespace: no one else's ports there
TOKENS = 30


class Site:
    """The server namespace's services and the deployment's settings, seen from the server."""

    def __init__(self, hosts: netns.Hosts) -> None:
        from orchestrator import Client
        from orchestrator.scripted_model import ScriptedModel
        from orchestrator.settings import Settings
        from orchestrator.store import RunStore
        from tests.servers import start_redis_server, wait_url

        self.hosts, self.folder = hosts, Path(tempfile.mkdtemp(prefix="tooloop-hosts-"))
        self.folder.chmod(0o755)  # the hosts' sandbox roots are below: tool calls run under their own uids
        address, password = hosts.address, uuid.uuid4().hex
        self.rabbit = netns.NamespaceRabbit(address)
        self.redis = start_redis_server(REDIS_PORT, self.folder, "--bind", address, "--requirepass", password)
        self.model = ScriptedModel(host=address, port=MODEL_PORT).start()
        self.env = {
            "TOOLOOP_REDIS_URL": f"redis://:{password}@{address}:{REDIS_PORT}/0",
            "TOOLOOP_BROKER_URL": self.rabbit.wait().url,
            "TOOLOOP_KEY_PREFIX": f"hosts-{uuid.uuid4().hex[:6]}",
            "TOOLOOP_ALLOWED_API_BASES": self.model.api_base,
            "TOOLOOP_RECOVERY_S": "6",
        }
        wait_url(self.env["TOOLOOP_REDIS_URL"])
        fields = {k.removeprefix("TOOLOOP_").lower(): v for k, v in self.env.items()}
        self.store = RunStore.from_settings(Settings(**fields))
        self.client = Client(settings=Settings(**fields), store=self.store)
        self.workers: dict[int, WorkerProcess] = {}

    def start_worker(self, n: int) -> WorkerProcess:
        """A worker on host n, with that host's own sandbox root."""
        root = self.folder / f"h{n}"
        root.mkdir(exist_ok=True)
        with netns.enter(self.hosts.hosts[n - 1]):  # the worker's processes live on host n
            proc = WorkerProcess(f"{self.env['TOOLOOP_KEY_PREFIX']}-h{n}", "-c", "4",
                                 env={**self.env, "TOOLOOP_SANDBOX_ROOT": str(root)})  # fmt: skip
        self.workers[n] = proc
        return proc.wait_ready(self.store)

    def stop(self) -> None:
        for proc in self.workers.values():
            proc.stop(timeout=5)
        self.model.stop()
        self.rabbit.stop()
        self.redis.kill()
        self.redis.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def site() -> Iterator[Site]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"cannot build hosts out of network namespaces: {reason}")
    if not (shutil.which("rabbitmq-server") and shutil.which("redis-server")):
        pytest.skip("rabbitmq-server and redis-server must be installed (they run in the server namespace)")
    hosts = netns.Hosts(workers=2)
    try:
        with netns.enter(hosts.server):  # this thread's sockets and processes: on the server
            built = Site(hosts)
            try:
                yield built
            finally:
                built.stop()
    finally:
        hosts.remove()


def steps() -> list:
    """Three turns; the first two each run a non-idempotent effect that names its host."""

    def turn(n: int, effect: bool):
        def step(request: dict) -> dict:
            served = {"content": f"turn {n} served by {request['_peer']}", "delay": 0.3, "tokens": TOKENS}
            if not effect:
                return served
            return {**served, **tools(call("effect_where", {"text": f"effect-{n}", "seconds": 1.0}))}

        return step

    return [turn(1, True), turn(2, True), turn(3, False)]


@pytest.mark.timeout(900)  # RabbitMQ's start, 50 runs, a cut longer than the recovery bound
def test_runs_spread_over_two_hosts_survive_one_cut_off(site: Site) -> None:
    h1, h2 = (netns.Hosts.host_address(n) for n in (1, 2))
    for n in (1, 2):
        site.start_worker(n)
    with netns.enter(site.hosts.hosts[0]):  # a host sees only the namespaces' network
        assert subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", "6379", "ping"],
                              capture_output=True, text=True).stdout.strip() != "PONG"  # fmt: skip
    model = site.model.script(steps())
    spec = {"prompt": "go", "model": model, "model_params": {"api_base": site.model.api_base},
            "tools": ["effect_where"]}  # fmt: skip
    handles = [site.client.submit(spec) for _ in range(RUNS)]

    # mid-run: once each host has a reply and a tool call recorded, cut host 1 off
    deadline = time.monotonic() + 300
    while (seen := served(site, handles)) != ({h1, h2}, {"h1", "h2"}) and time.monotonic() < deadline:
        time.sleep(1)
    assert seen == ({h1, h2}, {"h1", "h2"}), seen
    site.hosts.cut(1)
    cut_at = time.monotonic()
    in_flight = sum(not h.status().ended for h in handles)
    print(f"host 1 cut off with {in_flight} runs in flight", flush=True)
    assert in_flight, "every run ended before the cut: nothing was left to take over"
    served_before = len(site.model.calls(model))
    results = [h.wait(timeout=240) for h in handles]
    assert [r.status for r in results] == [Status.completed] * RUNS, [r.error for r in results]
    after_cut = site.model.calls(model)[served_before:]
    assert after_cut and {r["_peer"] for r in after_cut} == {h2}, "host 1 kept serving while cut off"

    # the run records: both hosts served turns (replies name the caller) and tools (records
    # name the host's sandbox root)
    assert served(site, handles) == ({h1, h2}, {"h1", "h2"})

    # host 1 back: it rejoins (serves turns of new runs), whatever it still held is refused,
    # and nothing ran twice
    site.hosts.mend(1)
    cut_for, mended = time.monotonic() - cut_at, time.time()
    name = f"turns@{site.workers[1].name}"
    wait_for(lambda: site.store.live_workers().get(name, {}).get("seen", 0) > mended, timeout=120)
    # Its broker connection either resumes (TCP retransmits, whose backoff reaches minutes)
    # or is found dead by the AMQP heartbeat and made again: either way, new runs keep
    # coming until host 1 serves one of them.
    served_before = len(site.model.calls(model))
    later: list = []
    deadline = time.monotonic() + 360
    while h1 not in {r["_peer"] for r in site.model.calls(model)[served_before:]}:
        assert time.monotonic() < deadline, "host 1 never served again after it came back"
        later += [site.client.submit(spec) for _ in range(5)]
        time.sleep(10)
    assert all(h.wait(timeout=240).status == Status.completed for h in later)
    # A reply host 1 was waiting for when cut off may reach it once mended: it is billed
    # (the provider billed it), not recorded. So: the same outcomes, every reply billed
    # once, never more replies billed than the model sent.
    again = [site.store.result(h.run_id) for h in handles]
    assert [(r.status, r.iterations) for r in again] == [(r.status, r.iterations) for r in results]
    billed = 0
    for r in again + [h.result() for h in later]:
        replies, left = divmod(r.tokens_used, TOKENS)
        assert left == 0 and r.iterations <= replies <= r.iterations + 1, (r.run_id, r.tokens_used)
        billed += replies
        lines = [line for n in (1, 2) for line in effect_lines(site, n, r.run_id)]
        assert len(lines) == len(set(lines)), f"{r.run_id}: an effect ran twice: {lines}"
    assert billed <= len(site.model.calls(model)), "more replies billed than the model sent"
    assert site.workers[1].proc.poll() is None and site.workers[2].proc.poll() is None
    print(
        f"host 1 cut off for {cut_for:.0f}s with {in_flight} runs in flight; "
        f"{len(after_cut)} model calls served by host 2 meanwhile"
    )


def served(site: Site, runs: list) -> tuple[set[str], set[str]]:
    """From the run records: the hosts whose replies were recorded (each reply names the
    address that called the model) and the hosts whose tool calls were (by sandbox root)."""
    turns, calls = set(), set()
    for run in runs:
        for m in site.store.messages(run.run_id):
            if m.get("role") == "assistant" and (m.get("content") or "").startswith("turn "):
                turns.add(m["content"].rsplit(" ", 1)[1])
        result = site.store.result(run.run_id)
        calls |= {Path(c.output).name for c in result.tool_calls if c.success} if result else set()
    return turns, calls


def effect_lines(site: Site, n: int, run_id: str) -> list[str]:
    path = site.folder / f"h{n}" / run_id / "effects.txt"
    return path.read_text().splitlines() if path.exists() else []
