"""docs/img/console-runs.png and docs/img/console-run.png, from real runs.

A private Redis, the scripted model, one ``tooloop worker``; a few runs (one that writes
and lists files, one whose call fails, one waiting for approval, one aborted), then the
runs list and one run's page in headless chromium at 1280x800.

    python bench/console_screenshots.py
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, environment, local_worker, scripted_spec

TOKEN = "screenshot-token"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def call(name: str, call_id: str, **arguments: object) -> dict:
    return {"id": call_id, "name": name, "arguments": arguments}


def main() -> None:
    with ExitStack() as stack:
        env = environment(stack, "tests.tools")
        client, model, _ = local_worker(stack, "shots", "-c", "4", env=env)
        base = _serve(stack)
        prompt = "Write a short plan into notes/plan.txt, count its lines, list the folder."
        steps = [
            {
                "content": "I'll write the plan first.",
                "tool_calls": [
                    call("write_file", "call_plan", path="notes/plan.txt", content="1. count\n2. list\n")
                ],
            },
            {
                "content": "Now count and list.",
                "tool_calls": [
                    call("shell", "call_wc", command="wc -l notes/plan.txt"),
                    call("list_dir", "call_ls", path="notes"),
                ],
            },
            {"content": '{"outcome": "done", "result": {"lines": 2}}'},
        ]
        fields = {
            "tools": ["write_file", "shell", "list_dir"],
            "outcome": {"enum": ["done", "stuck"]},
            "token_budget": 2000,
            "prompt": prompt,
        }
        shown = client.submit(scripted_spec(model, model.script(steps), **fields))
        failing = [{"tool_calls": [call("boom", "call_boom", message="disk full")]}, {"content": "Gave up."}]
        client.submit(
            scripted_spec(model, model.script(failing), tools=["boom"], prompt="Try the flaky tool.")
        )
        gated = [{"tool_calls": [call("guarded_append", "call_gate", text="deploy v2")]}, {"content": "ok"}]
        waiting = client.submit(
            scripted_spec(
                model,
                model.script(gated),
                tools=["guarded_append"],
                prompt="Append the release note (needs approval).",
            )
        )
        held = [{"content": "never", "delay": 30}]
        aborted = client.submit(
            scripted_spec(model, model.script(held), prompt="A run stopped by its operator.")
        )
        shown.wait(timeout=120)
        while not waiting.pending_approvals():
            time.sleep(0.1)
        aborted.abort("not needed any more")
        _shoot(base, shown.run_id)


def _serve(stack: ExitStack) -> str:
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.local import free_port
    from orchestrator.settings import Settings

    server = uvicorn.Server(
        uvicorn.Config(
            create_app(Settings(api_tokens=f"{TOKEN}=default")),
            host="127.0.0.1",
            port=(port := free_port()),
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    stack.callback(lambda: setattr(server, "should_exit", True))
    return f"http://127.0.0.1:{port}"


def _shoot(base: str, run_id: str) -> None:
    from playwright.sync_api import sync_playwright

    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        page = browser.new_page(base_url=base, viewport={"width": 1280, "height": 800})
        page.goto("/login")
        page.get_by_test_id("login-token").fill(TOKEN)
        page.get_by_test_id("login-submit").click()
        page.wait_for_url(f"{base}/")
        page.screenshot(path=str(out / "console-runs.png"))
        page.goto(f"/runs/{run_id}")
        page.get_by_test_id("turn").nth(2).wait_for()
        page.screenshot(path=str(out / "console-run.png"), full_page=True)
        browser.close()
    print(f"written {out / 'console-runs.png'} and {out / 'console-run.png'}")


if __name__ == "__main__":
    main()
