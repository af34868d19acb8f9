"""Shared set-up of the benchmarks: Redis, a scripted model, a worker, one key prefix."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def environment(stack: ExitStack, tools: str) -> dict[str, str]:
    """Set TOOLOOP_* for this process and its workers; returns the worker env."""
    from orchestrator.local import embedded_redis, redis_answers

    url = os.environ.get("TOOLOOP_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not redis_answers(url):
        url, server = embedded_redis()
        stack.callback(server.shutdown)
    env = {
        "TOOLOOP_REDIS_URL": url,
        "TOOLOOP_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
        "TOOLOOP_TOOLS": tools,
        "TOOLOOP_SANDBOX_ROOT": tempfile.mkdtemp(prefix="tooloop-bench-"),
        "OPENAI_API_KEY": "scripted",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    stack.callback(_cleanup, url, env["TOOLOOP_KEY_PREFIX"])
    return env


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


def scripted_spec(model_server, model: str, **fields) -> dict:
    """A spec dict for a model played by the scripted server."""
    params = {"api_base": model_server.api_base, "api_key_env": "OPENAI_API_KEY"}
    return {"prompt": "u", "model": model, "model_params": params, **fields}
