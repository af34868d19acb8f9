"""Real parts: a Redis, Celery workers as subprocesses, a scripted model over HTTP.

The suite uses ``TOOLOOP_REDIS_URL`` (default 127.0.0.1:6379) if it answers,
else starts a throwaway ``redis-server``; every session gets its own key prefix,
so runs never collide with other sessions sharing the server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.local import WorkerProcess, free_port, redis_answers

ROOT = Path(__file__).resolve().parent.parent
_started: list[subprocess.Popen] = []


def start_redis(port: int, *extra: str) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.exit("no Redis answers and redis-server is not installed", 2)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if redis_answers(url):
            return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def pytest_configure(config: pytest.Config) -> None:
    url = os.environ.get("TOOLOOP_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not redis_answers(url):
        port = free_port()
        _started.append(start_redis(port))
        url = f"redis://127.0.0.1:{port}/0"
    os.environ["TOOLOOP_REDIS_URL"] = url
    os.environ["TOOLOOP_KEY_PREFIX"] = f"test-{uuid.uuid4().hex[:8]}"
    os.environ["TOOLOOP_TOOLS"] = "tests.tools"
    os.environ["TOOLOOP_RECOVERY_S"] = os.environ.get("TOOLOOP_RECOVERY_S", "6")
    os.environ["TOOLOOP_SANDBOX_ROOT"] = tempfile.mkdtemp(prefix="tooloop-test-")
    os.environ["TOOLOOP_SECRET_KEY"] = "test-secret"
    os.environ["OPENAI_API_KEY"] = "sk-test"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def pytest_unconfigure(config: pytest.Config) -> None:
    import redis

    try:
        client = redis.Redis.from_url(os.environ["TOOLOOP_REDIS_URL"])
        keys = list(client.scan_iter(f"{os.environ['TOOLOOP_KEY_PREFIX']}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    except Exception:
        pass
    for proc in _started:
        proc.terminate()


# -- model --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def model_server() -> Iterator:
    from orchestrator.scripted_model import ScriptedModel

    server = ScriptedModel().start()
    yield server
    server.stop()


# -- workers ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def store():
    from orchestrator.store import RunStore

    return RunStore.from_settings()


@pytest.fixture(scope="session")
def client(store):
    from orchestrator import Client

    return Client(store=store)


@pytest.fixture(scope="session")
def worker(store) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(f"main-{uuid.uuid4().hex[:6]}", "-c", "4")
    try:
        yield proc.wait_ready(store)
    finally:
        proc.stop()


class Deployment:
    """A deployment of its own: key prefix, client, store, workers."""

    def __init__(self, prefix: str, env: dict[str, str]) -> None:
        from orchestrator import Client
        from orchestrator.settings import Settings
        from orchestrator.store import RunStore

        self.prefix, self.env = prefix, {"TOOLOOP_KEY_PREFIX": prefix, **env}
        self.settings = Settings(key_prefix=prefix, **{k.removeprefix("TOOLOOP_").lower(): v
                                                       for k, v in env.items() if k.startswith("TOOLOOP_")})
        self.store = RunStore.from_settings(self.settings)
        self.client = Client(settings=self.settings, store=self.store)
        self.workers: list[WorkerProcess] = []

    def start_worker(self, *args: str, roles: tuple[str, ...] = ("turns", "tools")) -> WorkerProcess:
        proc = WorkerProcess(f"{self.prefix}-{len(self.workers)}", *args, env=self.env)
        self.workers.append(proc)
        return proc.wait_ready(self.store, roles)

    def stop(self) -> None:
        for proc in self.workers:
            proc.stop()


@pytest.fixture
def deployment() -> Iterator:
    """Factory: ``deployment(**env)`` -> a Deployment with no workers yet (for tests that
    starve, kill or count workers without disturbing the shared one)."""
    made: list[Deployment] = []

    def make(**env: str) -> Deployment:
        d = Deployment(f"{os.environ['TOOLOOP_KEY_PREFIX']}-{uuid.uuid4().hex[:6]}", env)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


@pytest.fixture
def holds() -> Iterator[list]:
    """Events that keep scripted model steps waiting (see helpers.gate); released at teardown."""
    made: list = []
    yield made
    for event in made:
        event.set()


@pytest.fixture
def spec(model_server):
    """Build a spec dict that talks to the scripted model."""

    def make(steps, **fields):
        model = model_server.script(steps)
        params = {"api_base": model_server.api_base, **fields.pop("model_params", {})}
        return {"prompt": "do the task", "model": model, "model_params": params, **fields}

    return make
