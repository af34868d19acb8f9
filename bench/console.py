"""The run console: a 500-turn run's page in headless Chromium, and the runs list of a
tenant with 100,000 runs against one with 60 (both show a full page of 50 rows).

The 500-turn run is written through the store's real recording path (claim the turn,
record the reply with a tool call, start and record the call, the barrier, the next
turn; the last reply finishes the run): the same Lua a worker runs, without the model's
and the tools' own time. Its page is then loaded in Debian's chromium (Playwright), and
the Performance API gives time to first paint (first-contentful-paint) and to
interactive (domInteractive, and domContentLoaded: the script has run and the page's
controls answer). The list: GET / and its polled fragment over HTTP, median of 20.

    python bench/console.py [--turns 500] [--runs 100000]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish

TOKEN, SMALL_TOKEN = "bench-token", "bench-small-token"
SMALL = 60  # runs of the small tenant: more than a page, so both render 50 rows
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def long_run(store, turns: int, tenant: str = "bench") -> str:
    """A run of ``turns`` turns, each one tool call then the next turn; the last answers."""
    from orchestrator.models import RunSpec, ToolCallRecord
    from orchestrator.store import Finish

    run_id = f"long-{turns}"
    spec = RunSpec(
        prompt="Count to a big number, one call per turn.",
        model="openai/bench",
        tools=["add"],
        max_iterations=turns + 1,
        tenant=tenant,
        token_budget=100 * turns,
    )
    gen = store.create(run_id, spec, [{"role": "user", "content": spec.prompt}])
    for it in range(1, turns + 1):
        owner = f"o{it}"
        assert store.claim_turn(run_id, it, gen, owner) is not None
        if it == turns:
            store.record_finish(
                run_id,
                it,
                owner,
                {"role": "assistant", "content": "Counted."},
                30,
                Finish(exit="default", content="Counted."),
                0.0001,
            )
            break
        call_id = f"call_{it}"
        message = {
            "role": "assistant",
            "content": f"Turn {it}: adding one more.",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": it, "b": 1})},
                }
            ],
        }
        payload = {
            "run_id": run_id,
            "iteration": it,
            "index": 0,
            "key": f"{it}.0",
            "call_id": call_id,
            "tool": "add",
            "arguments": json.dumps({"a": it, "b": 1}),
            "allowed": True,
            "timeout_s": 30,
        }
        assert store.record_tool_calls(run_id, it, owner, message, 30, [payload], 0.0001) == "dispatch"
        start = store.start_call(run_id, it, 0, 1, owner, "add", True, False, True)
        assert start.verdict == "ok", start.verdict
        record = ToolCallRecord(
            call_id=call_id,
            tool_name="add",
            inputs={"a": it, "b": 1},
            output=it + 1,
            duration_ms=1.5,
            success=True,
            iteration=it,
        )
        tool_message = json.dumps({"role": "tool", "tool_call_id": call_id, "content": str(it + 1)})
        verdict, gen = store.record_call(run_id, it, 0, owner, record, tool_message, 1)
        assert verdict == "next", verdict
    return run_id


def serve(stack: ExitStack) -> str:
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.local import free_port
    from orchestrator.settings import Settings

    app = create_app(Settings(api_tokens=f"{TOKEN}=bench,{SMALL_TOKEN}=bench-small"))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True

    stack.callback(stop)
    return f"http://127.0.0.1:{port}"


def page_timings(base: str, path: str, loads: int = 7) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    figures: dict[str, list[float]] = {
        "first_paint_ms": [],
        "interactive_ms": [],
        "dom_content_loaded_ms": [],
        "html_kb": [],
    }
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        context = browser.new_context(base_url=base, viewport={"width": 1280, "height": 800})
        page = context.new_page()
        page.goto("/login")
        page.get_by_test_id("login-token").fill(TOKEN)
        page.get_by_test_id("login-submit").click()
        page.wait_for_url(f"{base}/")
        for _ in range(loads):
            page.goto(path, wait_until="load")
            nav = page.evaluate("JSON.stringify(performance.getEntriesByType('navigation')[0])")
            paint = page.evaluate(
                "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? null"
            )
            nav = json.loads(nav)
            figures["first_paint_ms"].append(paint or 0.0)
            figures["interactive_ms"].append(nav["domInteractive"])
            figures["dom_content_loaded_ms"].append(nav["domContentLoadedEventEnd"])
            figures["html_kb"].append(nav["transferSize"] / 1024)
        browser.close()
    return {k: statistics.median(v) for k, v in figures.items()}


def http_times(base: str, path: str, n: int = 20, token: str = TOKEN) -> float:
    """Median ms of GET ``path`` signed in (the page rendered on the server)."""
    import httpx

    with httpx.Client(base_url=base, timeout=60) as http:
        nonce = re.search(r'name="nonce" value="([^"]+)"', http.get("/login").text)[1]
        http.post("/login", data={"token": token, "nonce": nonce})
        times = []
        for _ in range(n):
            started = time.perf_counter()
            assert http.get(path).status_code == 200
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def many_runs(store, tenant: str, count: int) -> None:
    from orchestrator.models import RunSpec

    spec = RunSpec(prompt="a run among many", model="openai/bench", tenant=tenant)
    for i in range(count):
        store.create(f"{tenant}-{i:06d}", spec, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=500)
    parser.add_argument("--runs", type=int, default=100_000)
    args = parser.parse_args()
    with ExitStack() as stack:
        environment(stack, "")  # a private Redis and a key prefix of this bench's own
        from orchestrator.store import RunStore

        store = RunStore.from_settings()
        started = time.perf_counter()
        run_id = long_run(store, args.turns)
        written_s = time.perf_counter() - started
        base = serve(stack)
        run = page_timings(base, f"/runs/{run_id}")
        server_ms = http_times(base, f"/runs/{run_id}", n=5)
        live_ms = http_times(base, f"/runs/{run_id}/partials/live?since={args.turns - 1}", n=10)
        many_runs(store, "bench-small", SMALL)
        started = time.perf_counter()
        many_runs(store, "bench", args.runs)  # the tenant that also owns the long run
        filled_s = time.perf_counter() - started
        lines = [
            f"console bench: a {args.turns}-turn run ({args.turns - 1} tool calls), written in "
            f"{written_s:.1f} s through the store's recording scripts; median of 7 loads in headless "
            "chromium (1280x800)",
            f"  run page: first paint {run['first_paint_ms']:.0f} ms, interactive (domInteractive) "
            f"{run['interactive_ms']:.0f} ms, DOMContentLoaded (script run) "
            f"{run['dom_content_loaded_ms']:.0f} ms, HTML {run['html_kb']:.0f} KB; server render "
            f"{server_ms:.0f} ms (median of 5)",
            f"  live fragment (header + last turns, fetched per event burst): {live_ms:.1f} ms "
            "(median of 10)",
            f"runs list, tenant with {args.runs + 1:,} runs (written in {filled_s:.0f} s) vs one with "
            f"{SMALL} (a full page each); median of 20 GETs",
        ]
        for label, path in [
            ("first page", "/"),
            ("polled rows", "/partials/runs"),
            ("search, bounded window", "/?q=nothing-matches"),
            ("status filter", "/?status=failed"),
        ]:
            big, small = http_times(base, path), http_times(base, path, token=SMALL_TOKEN)
            lines.append(f"  {label}: {big:.1f} ms with {args.runs + 1:,} runs, {small:.1f} ms with {SMALL}")
        publish("console", lines)


if __name__ == "__main__":
    main()
