"""Small helpers shared by the test modules."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# How long a server started as a fresh interpreter (the API, Flower, an MCP server, a plain
# Celery worker) may take to answer: a readiness wait, not a measure of speed. Imports of a few
# seconds of CPU took over 30 s on this 2-core box loaded 15x its cores.
READY_S = 180.0


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie is dead for our purpose, and so is a process that ends
    while we look (reading its /proc entry then fails with ESRCH or ENOENT: a test once
    failed with the ProcessLookupError of the very exit it was waiting for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_for(predicate, timeout: float = 15, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


def call(name: str, arguments: object = None, call_id: str | None = None) -> dict:
    """One tool call of a scripted model step."""
    out = {"name": name, "arguments": {} if arguments is None else arguments}
    if call_id:
        out["id"] = call_id
    return out


def tools(*calls: dict, **extra: Any) -> dict:
    """A scripted model step that calls tools (``extra``: delay, tokens, hold...)."""
    return {"tool_calls": list(calls), **extra}


def gate(holds: list[threading.Event]) -> threading.Event:
    """An event that keeps a scripted step waiting; the ``holds`` fixture releases it."""
    event = threading.Event()
    holds.append(event)
    return event


def redis_values(redis_client: Any, pattern: str) -> dict[str, list[bytes]]:
    """Every value held under keys matching ``pattern``: string, each hash field and value,
    each list item, each stream entry field (for checks of what a run stores)."""
    out: dict[str, list[bytes]] = {}
    for key in redis_client.scan_iter(pattern, count=1000):
        kind = redis_client.type(key).decode()
        if kind == "string":
            values = [redis_client.get(key)]
        elif kind == "hash":
            values = [b for kv in redis_client.hgetall(key).items() for b in kv]
        elif kind == "list":
            values = redis_client.lrange(key, 0, -1)
        elif kind == "set":
            values = list(redis_client.smembers(key))
        elif kind == "zset":
            values = [m for m, _ in redis_client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            values = [b for _, fields in redis_client.xrange(key) for kv in fields.items() for b in kv]
        else:
            values = []
        out[key.decode()] = [v if isinstance(v, bytes) else str(v).encode() for v in values if v is not None]
    return out


def tool_run(spec, n: int = 3, **extra) -> dict:
    """A spec of ``n`` turns each calling ``add(i, 1)``, then "done"."""
    steps = [tools(call("add", {"a": i, "b": 1}), **extra) for i in range(n)] + [{"content": "done"}]
    return spec(steps, tools=["add"])


def assert_done(result, n: int = 3) -> None:
    """A ``tool_run`` run completed, every call recorded, each reply billed once."""
    from orchestrator import Status

    assert (result.status, result.content) == (Status.completed, "done")
    assert [r.output for r in result.tool_calls] == [i + 1 for i in range(n)]
    assert result.tokens_used == 30 * result.iterations


@contextlib.contextmanager
def flower(env: dict[str, str] | None = None) -> Iterator[str]:
    """``tooloop flower`` on a free port (``env``: over this process's); yields its base URL
    once it answers."""
    import httpx

    from orchestrator.local import free_port

    port = free_port()
    command = [sys.executable, "-m", "orchestrator.cli", "flower", f"--port={port}", "--address=127.0.0.1"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (python -m finds tests.tools)
    proc = subprocess.Popen(command, cwd=root, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(base + "/healthcheck", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, timeout=READY_S)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # a loaded box: Tornado's shutdown can take longer
            proc.kill()
            proc.wait(timeout=20)


def flower_tasks(base: str, run_id: str) -> list[dict]:
    """The tasks of one run, as Flower's API shows them."""
    import httpx

    return [t for t in httpx.get(base + "/api/tasks", timeout=5).json().values() if run_id in t["uuid"]]


TOOL_TURN_TASKS = frozenset({"tooloop.turn", "tooloop.tool"})


def flower_task_names(base: str, run_id: str, want: frozenset[str] = TOOL_TURN_TASKS) -> set[str] | None:
    """The names of a run's tasks in Flower once they include all of ``want``: Flower takes
    in events as they come, so a turn's may be there before its tool's."""
    names = {t["name"] for t in flower_tasks(base, run_id)}
    return names if names >= want else None


def once_flower_shows(submit: Callable[[], str], shown: Callable[[str], Any]) -> Any:
    """Submit runs (``submit`` returns an ended run's id) until ``shown(run_id)`` finds it in
    Flower, and return what it found: Flower's event receiver may start a moment late."""

    def attempt() -> Any:
        run_id = submit()
        try:
            return wait_for(lambda: shown(run_id), timeout=5)
        except AssertionError:
            return None

    return wait_for(attempt, timeout=60)
