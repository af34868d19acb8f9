"""The run console in a real browser: headless Chromium (Debian's) driven by Playwright,
against the API app served by uvicorn in a thread, the session's worker, Redis and the
scripted model. One browser for the module, a new context (cookies, storage) per test.

Pure pieces (paging, the timeline, sessions) are tested without a browser at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.helpers import call, gate, tools, wait_for
from tests.tools import LEAKED

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect

TOKENS = "tok-acme=acme,tok-globex=globex"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_MS = 30_000  # a loaded machine: the worker's turns, the page's poll and fetches
expect.set_options(timeout=WAIT_MS)


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def console_url(store) -> Iterator[str]:
    """The API app, console included, served by uvicorn in a thread (real HTTP)."""
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    app = create_app(Settings(api_tokens=TOKENS))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=10)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def sign_in(page: Any, token: str) -> None:
    page.get_by_test_id("login-token").fill(token)
    page.get_by_test_id("login-submit").click()


@pytest.fixture(scope="module")
def sessions(browser, console_url) -> dict[str, Any]:
    """Each tenant signed in once through the real form; tests start from its cookies."""
    states = {}
    for tenant in ("acme", "globex"):
        context = browser.new_context(base_url=console_url)
        page = context.new_page()
        page.goto("/login")
        sign_in(page, f"tok-{tenant}")
        page.wait_for_url(f"{console_url}/")
        states[tenant] = context.storage_state()
        context.close()
    return states


@contextlib.contextmanager
def _page(browser, console_url, state: Any, **options: Any) -> Iterator[Any]:
    context = browser.new_context(
        base_url=console_url,
        storage_state=state,
        viewport=options.pop("viewport", {"width": 1280, "height": 800}),
        **options,
    )
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.errors = errors
    yield page
    context.close()
    assert not errors, errors  # the page's script never threw


@pytest.fixture
def acme(browser, console_url, sessions) -> Iterator[Any]:
    with _page(browser, console_url, sessions["acme"]) as page:
        yield page


@pytest.fixture
def globex(browser, console_url, sessions) -> Iterator[Any]:
    with _page(browser, console_url, sessions["globex"]) as page:
        yield page


def cli_submit(data: dict[str, Any], tmp_path) -> str:
    """``tooloop submit SPEC`` in a subprocess: the run id it prints."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "submit", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def tool_call(page: Any, call_id: str) -> Any:
    return page.locator(f'[data-testid="tool-call"][data-call-id="{call_id}"]')


def status(page: Any) -> Any:
    return page.locator("#header").get_by_test_id("run-status")


def tab_to(page: Any, testid: str) -> None:
    """Press Tab until the control ``testid`` has the focus: it is reachable by keyboard."""
    for _ in range(60):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement?.dataset.testid") == testid:
            return
    raise AssertionError(f"{testid} cannot be reached with the keyboard")


def _event_streams(page: Any) -> list[Any]:
    """The page's requests for a run's event stream, as they are made (filled in place)."""
    seen: list[Any] = []
    page.on("request", lambda request: seen.append(request) if "/events" in request.url else None)
    return seen


def _a_run_whose_first_message_was_lost(client: Any, spec: Any) -> Any:
    """A run written to Redis whose first turn was never sent, as when the producer dies
    between its write and its publish: the sweeper finds it once its lease is due
    (``Settings.lease_s``: 10 s for the suite's workers) and sends it."""
    import uuid

    from orchestrator import dispatch

    def producer_dies(*args: Any) -> None:
        raise ConnectionError("the producer died before it published the run's first turn")

    run_id = uuid.uuid4().hex
    real, dispatch.enqueue_turn = dispatch.enqueue_turn, producer_dies
    try:
        with pytest.raises(ConnectionError):
            client.submit(spec([{"content": "recovered"}], tenant="acme"), run_id=run_id)
    finally:
        dispatch.enqueue_turn = real
    return client.get(run_id)


# -- the browser ------------------------------------------------------------------------------------
def test_sign_in_sets_a_strict_httponly_session_and_refuses_a_wrong_token(browser, console_url) -> None:
    context = browser.new_context(base_url=console_url)
    try:
        page = context.new_page()
        page.goto("/fleet")
        assert "/login?next=/fleet" in page.url  # not signed in: sent to sign in first
        sign_in(page, "tok-nope")
        expect(page.get_by_role("alert")).to_have_text("Unknown token.")
        assert not [c for c in context.cookies() if c["name"] == "tooloop_session"]
        sign_in(page, "tok-acme")
        page.wait_for_url(f"{console_url}/fleet")  # back where it was going
        expect(page.get_by_role("heading", name="Workers")).to_be_visible()
        [cookie] = [c for c in context.cookies() if c["name"] == "tooloop_session"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["expires"] > time.time()
        assert "tooloop_session" not in page.evaluate("document.cookie")  # no script can read it
        assert "tok-acme" not in json.dumps(context.cookies())  # no token kept in a cookie
    finally:
        context.close()


def test_a_cli_run_appears_live_and_its_page_fills_turn_by_turn(
    acme, spec, client, worker, holds, tmp_path
) -> None:
    from orchestrator.bounds import RECORD_MAX_BYTES

    lost = _a_run_whose_first_message_was_lost(client, spec)  # recovered by the sweeper meanwhile
    first, second, last = gate(holds), gate(holds), gate(holds)
    steps = [
        tools(call("add", {"a": 2, "b": 3}, call_id="c-add"), call("leaky", call_id="c-leak"),
              call("big_output", {"chars": 40_000}, call_id="c-big"), hold=first),
        tools(call("boom", {"message": "kaput"}, call_id="c-boom"), hold=second),
        {"content": "all done", "hold": last},
    ]  # fmt: skip
    data = spec(steps, tools=["add", "leaky", "boom", "big_output"], tenant="acme", token_budget=1000,
                cost_budget_usd=5.0, steering_files=["agents/reviewer/steering/style.md"])  # fmt: skip
    listing = acme.context.new_page()
    listing.goto("/")
    run_id = cli_submit(data, tmp_path)
    row = listing.locator(f'[data-testid="run-row"][data-run-id="{run_id}"]')
    expect(row).to_be_visible()  # without a reload: the list is live
    expect(row.get_by_test_id("run-status")).to_have_text(re.compile("queued|running"))

    page = acme
    streams = _event_streams(page)
    page.goto("/")
    page.locator(f'[data-testid="run-row"][data-run-id="{run_id}"] a').click()
    page.wait_for_url(f"**/runs/{run_id}")
    page.evaluate("window.notReloaded = true")
    expect(page.locator("#live-indicator")).to_be_visible()
    wait_for(lambda: streams, timeout=WAIT_MS / 1000)  # live by server-sent events, not by polling
    assert [(s.resource_type, s.url.split("?")[0]) for s in streams] == [
        ("eventsource", f"{page.url.split('#')[0]}/events")
    ]
    turns = page.get_by_test_id("turn")
    expect(turns).to_have_count(0)
    first.set()
    expect(turns).to_have_count(1)
    expect(tool_call(page, "c-add")).to_have_attribute("data-success", "true")
    expect(tool_call(page, "c-add").locator(".output")).to_have_text("5")
    expect(tool_call(page, "c-add").get_by_test_id("call-worker")).to_have_text(f"on tools@{worker.name}")
    expect(tool_call(page, "c-add").locator(".dur")).to_have_text(re.compile(r"^\d+ ms$"))  # its duration
    big = tool_call(page, "c-big").locator(".output")  # a large output: cut, as its record keeps it
    expect(big).to_contain_text("characters cut")
    shown = big.text_content()
    assert shown.startswith("HEAD") and shown.endswith("TAIL") and len(shown) <= RECORD_MAX_BYTES
    leak = tool_call(page, "c-leak")
    expect(leak).to_have_attribute("data-success", "true")
    expect(leak.locator(".output")).to_contain_text("[REDACTED]")  # a secret in a tool output: masked
    expect(leak.locator(".output")).to_contain_text('"count": 3')
    second.set()
    expect(turns).to_have_count(2)
    failed = tool_call(page, "c-boom")
    expect(failed).to_have_attribute("data-success", "false")
    expect(failed.locator(".error")).to_contain_text("kaput")  # a failed call's error
    last.set()
    expect(status(page)).to_have_text("completed")
    expect(turns).to_have_count(3)
    expect(page.get_by_test_id("turn").nth(2).get_by_test_id("model-text")).to_have_text("all done")
    expect(page.locator("#outcome")).to_contain_text("all done")
    expect(page.get_by_test_id("tokens-used")).to_have_text("90")
    expect(page.get_by_test_id("cost-usd")).to_have_text(re.compile(r"^\$\d"))
    tokens_meter, cost_meter = page.locator("#header meter").all()  # spent against the budgets
    assert (tokens_meter.get_attribute("max"), tokens_meter.get_attribute("value")) == ("1000", "90")
    expect(page.locator("#header")).to_contain_text("90 / 1,000")
    assert cost_meter.get_attribute("max") == "5.0" and float(cost_meter.get_attribute("value")) >= 0
    expect(page.locator("#header")).to_contain_text("/ $5.0000")
    expect(page.locator("#turn-1 .meta")).to_contain_text("30 tokens")  # each turn's share
    expect(page.locator("#turn-2 .meta")).to_contain_text("30 tokens")
    expect(page.locator("#live-indicator")).to_have_count(0)  # ended: the page stopped following
    expect(page.locator("#run")).to_have_attribute("data-live", "0")
    assert page.evaluate("window.notReloaded") is True  # all of it live, no reload
    html = page.content()
    assert not any(secret in html for secret in LEAKED.values())
    expect(row.get_by_test_id("run-status")).to_have_text("completed")  # the list followed too
    cells = {label: row.locator(f'td[data-label="{label}"]') for label in
             ("Status", "Agent · model", "Turns", "Tokens", "Cost", "Age", "Reason")}  # fmt: skip
    expect(cells["Status"].locator(".exit")).to_have_text("default")
    expect(cells["Agent · model"]).to_have_text(f"reviewer · {data['model']}")
    expect(cells["Turns"]).to_have_text("3")
    expect(cells["Tokens"]).to_have_text("90")
    expect(cells["Cost"]).to_have_text(re.compile(r"^\$\d+\.\d{4}$"))
    expect(cells["Age"]).to_have_text(re.compile(r"^\d+ (s|min) ago$"))  # in the viewer's words
    expect(cells["Reason"]).to_have_text("")  # completed: no failure to give a reason for

    streams.clear()
    page.goto(f"/runs/{run_id}#turn-2")  # a deep link to a turn; an ended run's page is not live
    expect(page.locator("#turn-2")).to_be_in_viewport()
    page.wait_for_load_state("networkidle")
    assert streams == [] and page.locator("#live-indicator").count() == 0  # it opens no event stream
    listing.close()

    # the run whose first message was lost: the sweeper sent it again, and its page says so
    assert lost.wait(timeout=90).content == "recovered"
    page.goto(f"/runs/{lost.run_id}")
    expect(page.locator("#timeline .n-recovery")).to_have_text(
        re.compile(r"recovered: turn sent again to a live worker$")
    )


def test_pause_steer_resume_and_the_model_sees_the_steer(
    acme, spec, client, worker, holds, model_server
) -> None:
    reply = gate(holds)
    data = spec(
        [tools(call("add", {"a": 1, "b": 1}, call_id="c1"), hold=reply), {"content": "done"}],
        tools=["add"],
        tenant="acme",
    )
    handle = client.submit(data)
    page = acme
    page.goto(f"/runs/{handle.run_id}")
    expect(status(page)).to_have_text(re.compile("queued|running"))
    tab_to(page, "pause")  # keyboard only, every control of this test: Tab to it, then Enter
    page.keyboard.press("Enter")
    expect(status(page)).to_have_text("paused")
    expect(page.get_by_test_id("action-result")).to_contain_text("Paused")
    expect(page.get_by_test_id("resume")).to_be_enabled()
    tab_to(page, "steer-input")
    page.keyboard.type("Use the blue door.")
    tab_to(page, "steer-send")
    page.keyboard.press("Enter")
    expect(page.get_by_test_id("action-result")).to_contain_text("Steer queued")
    expect(page.get_by_test_id("steer-input")).to_have_value("")
    reply.set()  # the reply is recorded; its call waits for resume
    expect(page.get_by_test_id("turn")).to_have_count(1)
    assert handle.status() == "paused"
    tab_to(page, "resume")
    page.keyboard.press("Enter")
    expect(status(page)).to_have_text("completed")
    expect(page.locator("#turn-2 .guidance")).to_have_text("Use the blue door.")
    expect(page.locator("#timeline")).to_contain_text("pause by console:acme")
    seen = model_server.calls(data["model"])[-1]["messages"]
    assert any("Use the blue door." in str(m.get("content")) for m in seen)  # the steer reached the model
    page.get_by_test_id("resume").wait_for(state="detached")  # an ended run has no controls


def test_approve_shows_inputs_first_and_a_denial_reaches_the_model(
    acme, spec, client, worker, model_server
) -> None:
    data = spec(
        [
            tools(
                call("guarded_append", {"text": "ship it"}, call_id="g1"),
                call("guarded_append", {"text": "drop tables"}, call_id="g2"),
            ),
            {"content": "done"},
        ],
        tools=["guarded_append"],
        tenant="acme",
    )
    handle = client.submit(data)
    page = acme
    page.goto(f"/runs/{handle.run_id}")
    approve, deny = page.get_by_test_id("approve-g1"), page.get_by_test_id("deny-g2")
    expect(approve).to_be_visible()
    # the fleet, as `tooloop doctor` says it: live workers, their queues and sandbox layers,
    # queue depths, and this tenant's runs waiting for a person
    fleet = page.context.new_page()
    fleet.goto("/fleet")
    tools_row = fleet.get_by_test_id("worker").filter(has_text=f"tools@{worker.name}")
    expect(tools_row).to_contain_text(client.store.keys.tool_queue)
    expect(tools_row.locator(".badge").first).to_be_visible()  # a live sandbox layer
    expect(fleet.get_by_test_id("queue-depth").first).to_have_text(re.compile(r"^\d+$"))
    expect(fleet.locator(f'a[href="/runs/{handle.run_id}"]')).to_be_visible()
    fleet.close()
    expect(tool_call(page, "g1").locator(".inputs")).to_contain_text("ship it")  # inputs before deciding
    expect(tool_call(page, "g2").locator(".inputs")).to_contain_text("drop tables")
    expect(tool_call(page, "g1")).to_have_attribute("data-success", "pending")
    tab_to(page, "approve-g1")  # by keyboard
    page.keyboard.press("Enter")
    expect(tool_call(page, "g1")).to_have_attribute("data-success", "true")
    tool_call(page, "g2").get_by_label("Reason").fill("not on a Friday")
    deny.click()
    expect(status(page)).to_have_text("completed")
    expect(tool_call(page, "g2")).to_have_attribute("data-success", "false")
    expect(tool_call(page, "g2").locator(".error")).to_contain_text("not on a Friday")
    tool_messages = [m for m in model_server.calls(data["model"])[-1]["messages"] if m["role"] == "tool"]
    assert any("not on a Friday" in str(m["content"]) for m in tool_messages)  # the model was told


def test_abort_asks_first_csrf_and_tenants(acme, globex, spec, client, worker, holds, console_url) -> None:
    prompt = f"abort me {os.urandom(4).hex()}"
    data = spec([{"content": "never", "hold": gate(holds)}], tenant="acme", prompt=prompt)
    handle = client.submit(data)
    page = acme
    page.goto(f"/runs/{handle.run_id}")
    stale = page.context.new_page()  # a second tab whose event stream is cut: it misses the abort
    stale.route("**/events?**", lambda route: route.abort())
    stale.goto(f"/runs/{handle.run_id}")
    expect(stale.get_by_test_id("pause")).to_be_enabled()
    # a change without the CSRF token is refused (same session cookie, no token)
    refused = page.request.post(f"/runs/{handle.run_id}/abort", headers={"Accept": "application/json"})
    assert refused.status == 403 and handle.status() != "aborted"
    # another tenant: the run is a 404, in the browser and for its controls
    response = globex.goto(f"/runs/{handle.run_id}")
    assert response.status == 404
    expect(globex.get_by_role("heading")).to_contain_text("No run")
    globex.goto("/")
    expect(globex.locator(f'[data-run-id="{handle.run_id}"]')).to_have_count(0)
    csrf = globex.evaluate("document.querySelector('meta[name=csrf-token]').content")
    stolen = globex.request.post(f"/runs/{handle.run_id}/abort", headers={"X-CSRF-Token": csrf})
    assert stolen.status == 404 and handle.status() != "aborted"

    page.get_by_test_id("abort").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_be_visible()
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    assert handle.status() != "aborted"
    tab_to(page, "abort")  # by keyboard: the dialog takes the focus, its reason first
    page.keyboard.press("Enter")
    expect(page.get_by_role("dialog").get_by_label("Reason")).to_be_focused()
    page.keyboard.type("not needed any more")
    tab_to(page, "abort-confirm")
    page.keyboard.press("Enter")
    expect(status(page)).to_have_text("aborted")
    assert handle.result().exit == "aborted"
    expect(page.locator("#timeline .n-control")).to_contain_text("abort by console:acme")  # in place
    expect(page.get_by_role("alert")).to_contain_text("not needed any more")

    stale.get_by_test_id("pause").click()  # refused: the page says why
    result = stale.get_by_test_id("action-result")
    expect(result).to_have_text("The run has already ended.")
    expect(result).to_have_attribute("data-ok", "false")
    stale.close()

    # the list, filtered by status and searched by prompt through its form
    page.goto("/")
    page.get_by_test_id("status-filter").select_option("aborted")
    page.get_by_test_id("search").fill(prompt.upper())
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r"status=aborted"))
    row = page.get_by_test_id("run-row")
    expect(row).to_have_count(1)  # only this run matches
    expect(row).to_have_attribute("data-run-id", handle.run_id)
    expect(row.locator(".exit")).to_have_text("aborted")
    expect(row.locator('td[data-label="Reason"]')).to_contain_text("not needed any more")
    page.get_by_test_id("status-filter").select_option("running")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r"status=running"))
    expect(page.get_by_test_id("run-row")).to_have_count(0)
    expect(page.locator("#rows .empty")).to_contain_text("No run matches")


def test_streamed_text_shows_while_the_turn_runs_and_a_phone_fits(
    browser, console_url, sessions, spec, client, worker, holds
) -> None:
    start = gate(holds)
    words = "Thinking hard about it. " * 5 + "Done."  # a first piece of 100 characters: the worker
    # sends streamed text on in pieces of 80 characters or more (worker/streaming.py)
    data = spec(
        [{"content": words, "chunk_chars": 100, "stall": 3, "hold": start}],
        tenant="acme",
        model_params={"stream": True},
    )
    phone = {"viewport": {"width": 390, "height": 844}, "timezone_id": "Asia/Kathmandu", "locale": "en-GB"}
    with _page(browser, console_url, sessions["acme"], **phone) as page:
        handle = client.submit(data)
        page.goto(f"/runs/{handle.run_id}")
        created = page.locator("#header dd time").first  # shown in the viewer's zone (UTC+05:45)
        stamp = created.get_attribute("datetime")
        shown = page.evaluate(
            "s => new Date(s).toLocaleString('en-GB', {timeZone: 'Asia/Kathmandu'})", stamp
        )
        expect(created).to_have_text(shown)
        expect(page.get_by_test_id("turn-pending")).to_be_visible()
        start.set()  # the page is open: the reply starts streaming, then stalls after its first piece
        streaming = page.locator('[data-testid="turn-pending"] [data-testid="model-text"]')
        expect(streaming).to_contain_text("Thinking")  # the first piece, before the reply is recorded
        assert handle.status() != "completed"
        expect(status(page)).to_have_text("completed")
        expect(page.get_by_test_id("turn").get_by_test_id("model-text")).to_have_text(words)
        assert page.evaluate(
            "document.documentElement.scrollWidth <= window.innerWidth"
        )  # no sideways scroll
        page.goto("/")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_fork_here_opens_the_forks_page_with_its_warning(acme, spec, client, worker, model_server) -> None:
    data = spec([tools(call("append_line", {"text": "a"})), tools(call("add", {"a": 1, "b": 2})),
                 {"content": "done"}], tools=["append_line", "add"], tenant="acme")  # fmt: skip
    handle = client.submit(data)
    assert handle.wait(timeout=60).status == "completed"
    page = acme
    page.goto(f"/runs/{handle.run_id}")
    expect(page.get_by_test_id("fork-4")).to_be_visible()  # after the last turn: continue in a fork
    page.get_by_test_id("fork-2").click()  # the same code as `tooloop fork --at 2`
    page.wait_for_url(re.compile(r"/runs/(?!" + handle.run_id + r")[0-9a-f]{32}$"))
    fork_id = page.url.rsplit("/", 1)[1]
    expect(page.get_by_test_id("forked-from")).to_have_text(handle.run_id)
    expect(page.locator(".n-fork_warning")).to_contain_text("append_line")
    expect(status(page)).to_have_text("completed")
    assert client.get(fork_id).result().forked_from.iteration == 2
    assert model_server.calls(data["model"])[-1]["messages"][-1]["content"] == "3"  # its own turn 2 ran


# -- without a browser: the routes' guarantees ------------------------------------------------------
def test_every_change_needs_the_csrf_token_and_a_session(console_url, client, spec, worker, holds) -> None:
    handle = client.submit(spec([{"content": "x", "hold": gate(holds)}], tenant="acme"))
    with httpx.Client(base_url=console_url, timeout=30) as http:
        assert http.get("/").status_code == 303  # not signed in
        assert http.post(f"/runs/{handle.run_id}/pause").status_code == 401
        http.get("/login")
        forged = http.post("/login", data={"token": "tok-acme", "nonce": "forged"})
        assert forged.status_code == 403 and "tooloop_session" not in http.cookies
        nonce = re.search(r'name="nonce" value="([^"]+)"', forged.text)[1]  # the fresh form's
        assert http.post("/login", data={"token": "tok-acme", "nonce": nonce}).status_code == 303
        paths = [f"/runs/{handle.run_id}/{a}" for a in ("pause", "resume", "steer", "abort")]
        paths += [f"/runs/{handle.run_id}/calls/x/approve", f"/runs/{handle.run_id}/calls/x/deny", "/logout"]
        for path in paths:
            assert http.post(path, data={"message": "x"}).status_code == 403, path
            assert http.post(path, data={"csrf": "wrong", "message": "x"}).status_code == 403, path
        assert handle.status() != "paused"
        run_page = http.get(f"/runs/{handle.run_id}")
        csp = run_page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        token = re.search(r'name="csrf-token" content="([^"]+)"', run_page.text)[1]
        other_origin = {"X-CSRF-Token": token, "Origin": "http://evil.example", "Accept": "application/json"}
        assert http.post(f"/runs/{handle.run_id}/pause", headers=other_origin).status_code == 403
        ok = http.post(
            f"/runs/{handle.run_id}/pause", headers={"X-CSRF-Token": token, "Accept": "application/json"}
        )
        assert ok.status_code == 200 and ok.json()["status"] == "paused"
        again = http.post(
            f"/runs/{handle.run_id}/resume", data={"csrf": token}, headers={"Accept": "application/json"}
        )
        assert again.json()["ok"] and handle.status() != "paused"
        ended = http.post(
            f"/runs/{handle.run_id}/abort", data={"csrf": token}, headers={"Accept": "application/json"}
        )
        assert ended.status_code == 200
        refused = http.post(
            f"/runs/{handle.run_id}/pause", data={"csrf": token}, headers={"Accept": "application/json"}
        )
        assert refused.status_code == 409 and refused.json()["message"] == "The run has already ended."
    schema = httpx.get(f"{console_url}/openapi.json").json()["paths"]
    assert "/" not in schema and not any(p.startswith("/runs") for p in schema)  # the API's document only


# -- pure pieces and the command ----------------------------------------------------------------------
def test_sessions_are_signed_expire_and_end_with_their_token(monkeypatch) -> None:
    import itsdangerous.timed

    from orchestrator.console.auth import SESSION_MAX_AGE_S, Sessions
    from orchestrator.console.web import safe_next
    from orchestrator.tokens import token_digest

    digests = {token_digest("tok-a"): "acme"}
    sessions = Sessions(digests, "secret")
    cookie = sessions.open("tok-a")
    assert sessions.open("tok-b") is None and sessions.read_value(cookie).tenant == "acme"
    assert (
        sessions.read_value(cookie).csrf
        != Sessions(digests, "secret").read_value(sessions.open("tok-a")).csrf
    )
    tampered = cookie[:-2] + ("A" if cookie[-2] != "A" else "B") + cookie[-1]
    assert sessions.read_value(tampered) is None
    assert Sessions(digests, "another secret").read_value(cookie) is None  # signed with the server's key
    assert Sessions({token_digest("tok-new"): "acme"}, "secret").read_value(cookie) is None  # token revoked
    assert (
        Sessions(digests, "secret", insecure_local=True).read_value(sessions.open_local()).tenant == "default"
    )
    assert sessions.read_value(sessions.open_local()) is None  # a local session only in --insecure-local
    now = time.time()
    monkeypatch.setattr(itsdangerous.timed.time, "time", lambda: now + SESSION_MAX_AGE_S + 5)
    assert sessions.read_value(cookie) is None  # expired
    for target, safe in [("/runs/x#turn-2", "/runs/x#turn-2"), ("//evil.example/", "/"),
                         ("https://evil.example/", "/"), ("/\\evil", "/"), ("", "/")]:  # fmt: skip
        assert safe_next(target) == safe


def test_runs_pages_follow_the_index_without_gaps_and_a_search_stays_bounded(deployment, monkeypatch) -> None:
    from orchestrator.console import listing
    from orchestrator.models import RunSpec

    store = deployment().store  # a prefix of its own, and no worker to pick these runs up
    made = []
    for i in range(130):  # created back to back: many share a millisecond (ties in the index)
        prompt = f"task {i} needle" if i % 10 == 0 else f"task {i}"
        run_id = f"r{i:03d}-{os.urandom(3).hex()}"
        store.create(run_id, RunSpec(prompt=prompt, model="openai/x", tenant="pager"), [])
        made.append(run_id)
    store.create("other-tenant-run", RunSpec(prompt="needle", model="openai/x", tenant="else"), [])
    created = {r: int(store.state(r)["created_at"]) for r in made}
    newest_first = sorted(made, key=lambda r: (created[r], r), reverse=True)

    def follow(**query: str) -> list[list[str]]:
        pages, before = [], None
        while True:
            page = listing.page(store, "pager", before=before, **query)
            pages.append([row.run_id for row in page.rows])
            if page.next_cursor is None:
                return pages
            before = page.next_cursor

    pages = follow()
    assert [len(p) for p in pages] == [50, 50, 30] and [r for p in pages for r in p] == newest_first
    needles = [r for r in newest_first if int(r[1:4]) % 10 == 0]
    assert follow(q="NEEDLE") == [needles]  # prompt text, any case; another tenant's never
    assert follow(q=made[7]) == [[made[7]]]  # a whole run id
    assert follow(status="failed") == [[]]
    monkeypatch.setattr(listing, "SEARCH_WINDOW", 40)  # each request examines 40 runs at most
    windows = follow(q="needle")
    assert len(windows) == 4 and [r for w in windows for r in w] == needles
    first = listing.page(store, "pager", q="needle")
    assert first.window_spent and first.scanned == 40


def test_the_timeline_places_text_calls_tokens_and_control_events() -> None:
    from orchestrator.console.timeline import build
    from orchestrator.store import steer_message

    call_1 = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    call_2 = {"id": "c2", "type": "function", "function": {"name": "deploy", "arguments": '{"to": "prod"}'}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "do it"},
                {"role": "assistant", "content": "adding", "tool_calls": [call_1]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
                {"role": "system", "content": steer_message("Use X.")},
                {"role": "assistant", "content": None, "tool_calls": [call_1, call_2]}]  # fmt: skip
    record = {"call_id": "c1", "tool_name": "add", "inputs": {"a": 1}, "output": 2, "duration_ms": 3.0,
              "success": True, "iteration": 1}  # fmt: skip
    calls = {"1.0": record, "2.0": {**record, "iteration": 2}}
    approvals = {"2.1": {"state": "pending", "call_id": "c2", "tool": "deploy", "iteration": 2}}
    events = [{"id": "1-0", "type": "queued", "ts": 1},
              {"id": "2-0", "type": "iteration", "iteration": 1, "tokens_used": 30, "cost_usd": 0.001,
               "ts": 2},
              {"id": "3-0", "type": "control", "action": "pause", "by": "console:acme", "ts": 3},
              {"id": "4-0", "type": "iteration", "iteration": 2, "tokens_used": 70, "cost_usd": 0.003,
               "ts": 4},
              {"id": "5-0", "type": "approval", "iteration": 2, "call_id": "c2", "tool": "deploy",
               "decision": "pending", "arguments": '{"to": "*[REDACTED]"}', "ts": 5},
              {"id": "6-0", "type": "text", "iteration": 3, "text": "thinking", "ts": 6}]  # fmt: skip
    state = {"status": "running", "iteration": "2", "tokens_used": "70", "cost_usd": "0.003",
             "spec": json.dumps({"prompt": "do it", "model": "openai/m", "steering_files":
                                 ["agents/reviewer/steering/style.md"]})}  # fmt: skip
    run = build("r1", state, messages, calls, approvals, events)
    one, two, three = run.turns
    assert (run.agent, run.waiting, run.last_event_id) == ("reviewer", 1, "6-0")
    assert (one.text, one.tokens, one.cost_usd) == ("adding", 30, 0.001)
    assert [n.text for n in one.notes] == ["pause by console:acme"]  # in the turn it happened in
    assert (
        two.tokens == 40 and abs(two.cost_usd - 0.002) < 1e-9 and [g.text for g in two.guidance] == ["Use X."]
    )
    recorded, waiting = two.calls
    assert (recorded.output, recorded.success, waiting.success, waiting.waiting) == ("2", True, None, True)
    assert json.loads(waiting.inputs) == {"to": "*[REDACTED]"}  # what the approval event carries
    assert three.pending and three.streamed == "thinking" and not run.ended
    state.update(status="completed", iteration="2")
    assert [t.iteration for t in build("r1", state, messages, calls, {}, events[:4]).turns] == [1, 2]


def test_api_refuses_to_start_without_tokens_unless_insecure_local(monkeypatch) -> None:
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from orchestrator.api import create_app
    from orchestrator.cli import app as cli
    from orchestrator.settings import Settings, get_settings

    monkeypatch.setenv("TOOLOOP_API_TOKENS", "")
    get_settings.cache_clear()
    try:
        refused = CliRunner().invoke(cli, ["api", "--port", "1"])
        assert refused.exit_code == 2 and "--insecure-local" in refused.output
        wide = CliRunner().invoke(cli, ["api", "--insecure-local", "--host", "0.0.0.0", "--port", "1"])
        assert wide.exit_code == 2 and "loopback only" in wide.output
    finally:
        get_settings.cache_clear()
    with TestClient(create_app(Settings(api_tokens=""), insecure_local=True)) as http:
        page = http.get("/fleet")  # signed in as the local tenant, no token
        assert page.status_code == 200 and "tenant <b>default</b>" in page.text
        assert "samesite=strict" in page.headers["set-cookie"].lower()
