"""`tooloop` as users run it: subprocesses, pipes, exit codes, a second terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import Status
from orchestrator.views import event_line
from tests.conftest import ROOT
from tests.helpers import READY_S, flower, flower_task_names, gate, once_flower_shows, wait_for


def tooloop(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout,
    )  # fmt: skip




def cli(*args: str) -> Any:
    """``tooloop ARGS`` in this process (typer's CliRunner): the same commands, without
    a second of interpreter start per call. ``.stdout`` and ``.stderr`` apart."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.fixture
def own_prefix(monkeypatch) -> Iterator[str]:
    """This test's in-process commands under a key prefix of their own: all they write is
    under it (the session's workers and other tests write under theirs)."""
    from orchestrator.settings import get_settings

    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("TOOLOOP_KEY_PREFIX", prefix)
    get_settings.cache_clear()
    yield prefix
    monkeypatch.undo()
    get_settings.cache_clear()


def keys_under(prefix: str) -> list[bytes]:
    from orchestrator.store import RunStore

    return list(RunStore.from_settings().redis.scan_iter(f"{prefix}*", count=1000))


def write_spec(tmp_path: Path, data: dict[str, Any], name: str = "spec.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def add_call(**extra: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}], **extra}






# -- submit / status: stdout and exit codes ---------------------------------------------------
def test_submit_wait_json_prints_one_document_and_exits_0(tmp_path, worker, spec) -> None:
    path = write_spec(tmp_path, spec([add_call(), {"content": "5"}], tools=["add"]))
    done = tooloop("submit", str(path), "--wait", "--json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1  # exactly one JSON document, on one line
    result = json.loads(done.stdout)
    assert (result["status"], result["exit"], result["content"]) == ("completed", "default", "5")
    assert result["tool_calls"][0]["output"] == 5
    assert "submitted" in done.stderr  # progress goes to stderr

    status = tooloop("status", result["run_id"], "--json")
    assert status.returncode == 0 and json.loads(status.stdout) == result
    human = tooloop("status", result["run_id"])
    assert human.returncode == 0 and "completed (default)" in human.stdout


def test_submit_wait_exits_1_on_a_reserved_exit(tmp_path, worker, spec) -> None:
    path = write_spec(tmp_path, spec([add_call()], tools=["add"], max_iterations=1))
    done = tooloop("submit", str(path), "--wait", "--json")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert (result["status"], result["exit"], result["terminated_by_limit"]) == (
        "failed",
        "max_iterations",
        True,
    )


def test_submit_without_wait(tmp_path, worker, spec, client) -> None:
    path = write_spec(tmp_path, spec([{"content": "hi"}]))
    plain = tooloop("submit", str(path))
    assert plain.returncode == 0
    run_id = plain.stdout.strip()
    assert plain.stdout == run_id + "\n" and client.get(run_id).wait(timeout=20).content == "hi"
    as_json = tooloop("submit", str(path), "--json", "--prompt", "other task")
    document = json.loads(as_json.stdout)
    assert set(document) == {"run_id", "status"} and document["status"] in ("queued", "running", "completed")


def test_refused_spec_and_bad_usage_exit_2(tmp_path, spec, model_server) -> None:
    refused = tooloop("submit", str(write_spec(tmp_path, {**spec([{"content": "x"}]), "colour": "red"})))
    assert refused.returncode == 2 and refused.stdout == ""
    assert "colour: unknown field" in refused.stderr
    empty_prompt = tooloop(
        "submit", str(write_spec(tmp_path, spec([{"content": "x"}], prompt=" "), "e.json"))
    )
    assert empty_prompt.returncode == 2 and "prompt" in empty_prompt.stderr
    assert tooloop("submit").returncode == 2  # missing argument
    assert tooloop("status", "no-such-run").returncode == 2
    assert tooloop("watch", "no-such-run").returncode == 2
    assert tooloop("frobnicate").returncode == 2


def test_every_json_error_is_one_document_with_the_same_exit_code(tmp_path, spec, model_server) -> None:
    """Failed before: with --json an error wrote nothing to stdout (usage errors neither)."""
    refused = write_spec(tmp_path, {**spec([{"content": "x"}]), "colour": "red"})
    cases = [
        (("submit", str(refused), "--json"), 2, "spec_refused", "colour: unknown field"),
        (("submit", str(tmp_path / "gone.yaml"), "--json"), 2, "spec_refused", "gone.yaml"),
        (("submit", "--json"), 2, "usage", "Missing argument"),
        (("status", "nosuchrun", "--json"), 2, "not_found", "no run 'nosuchrun'"),
        (("status", "--json"), 2, "usage", "Missing argument"),
        (("list", "--limit", "many", "--json"), 2, "usage", "--limit"),
        (("tools", "--json", "--colour"), 2, "usage", "--colour"),
        (("doctor", "--colour", "--json"), 2, "usage", "--colour"),
        (("frobnicate", "--json"), 2, "usage", "frobnicate"),
    ]
    for args, code, kind, said in cases:
        done = cli(*args)
        assert done.exit_code == code, (args, done.output)
        assert done.stdout.count("\n") == 1, (args, done.stdout)  # one document, one line
        document = json.loads(done.stdout)
        assert list(document) == ["error"] and document["error"]["type"] == kind, (args, document)
        assert said in document["error"]["message"] and said in done.stderr, (args, done.stderr)
        plain = cli(*(a for a in args if a != "--json"))
        assert (plain.exit_code, plain.stdout) == (code, ""), (args, plain.stdout)  # same code, no JSON


def test_the_cli_refuses_input_out_of_bounds_before_writing(tmp_path, spec, model_server, own_prefix) -> None:
    """Failed before: a 5 MB prompt, `max_iterations: true` or "5" were submitted, `--timeout -5`
    created the run (then "still running"), and an abort reason had no bound."""
    import yaml

    from orchestrator.bounds import REASON_MAX_CHARS, SPEC_MAX_BYTES
    from orchestrator.models import RunSpec
    from orchestrator.store import RunStore

    base = spec([{"content": "x"}])
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text(yaml.safe_dump({**base, "max_iterations": "5"}))
    cases = [
        (write_spec(tmp_path, {**base, "prompt": "p" * SPEC_MAX_BYTES}, "huge.json"), (), "spec_refused",
         f"the limit is {SPEC_MAX_BYTES:,}"),
        (write_spec(tmp_path, {**base, "max_iterations": True}, "flag.json"), (), "spec_refused",
         "max_iterations: Input should be a valid integer, not True"),
        (quoted, (), "spec_refused", "max_iterations: Input should be a valid integer, not '5'"),
        (write_spec(tmp_path, base, "ok.json"), ("--wait", "--timeout", "-5"), "usage", "--timeout"),
        (write_spec(tmp_path, base, "ok.json"), ("--wait", "--timeout", "0"), "usage", "--timeout"),
    ]  # fmt: skip
    for path, extra, kind, said in cases:
        done = cli("submit", str(path), *extra, "--json")
        error = json.loads(done.stdout)["error"]
        assert (done.exit_code, error["type"]) == (2, kind) and said in error["message"], (path, extra, error)
    assert keys_under(own_prefix) == []  # nothing written, nothing enqueued

    store = RunStore.from_settings()
    run_id = uuid.uuid4().hex
    store.create(run_id, RunSpec.model_validate(base), [{"role": "user", "content": "x"}])  # queued
    events = store.redis.xlen(store.keys.events(run_id))
    too_long = "r" * (REASON_MAX_CHARS + 1)
    for args in (("abort", run_id, "--reason", too_long), ("deny", run_id, "call-1", "--reason", too_long)):
        done = cli(*args)
        assert done.exit_code == 2 and f"the limit is {REASON_MAX_CHARS:,}" in done.stderr, done.output
    assert store.status(run_id) == Status.queued and store.redis.xlen(store.keys.events(run_id)) == events
    assert cli("abort", run_id, "--reason", "r" * REASON_MAX_CHARS).exit_code == 0  # at the bound: taken
    assert store.result(run_id).error.endswith("r" * REASON_MAX_CHARS)


def test_a_client_sends_to_its_own_prefix_whatever_the_module_app_was_made_with(own_prefix, monkeypatch):
    """The module's Celery app is made once, at import, from the environment of then; a
    client made since under another prefix must not send through it (its turns went to
    queues no worker reads: each run 'recovered' by the sweeper a lease later)."""
    from orchestrator import Client, dispatch
    from orchestrator.settings import get_settings

    stale = get_settings().model_copy(update={"key_prefix": f"{own_prefix}-stale"})
    module_app = dispatch.make_app(stale)
    monkeypatch.setattr(dispatch, "default_app", lambda: module_app)
    client = Client()
    assert client.settings.key_prefix == own_prefix
    assert client.celery.tooloop_settings.key_prefix == own_prefix
    assert Client(settings=stale).celery is module_app  # the same settings: the same app


# -- list and watch ----------------------------------------------------------------------------
def test_list_in_a_pipe_is_a_plain_table(client, worker, spec) -> None:
    handle = client.submit(spec([{"content": "listed"}], tenant="lister"))
    handle.wait(timeout=20)
    table = tooloop("list", "--tenant", "lister")
    assert table.returncode == 0
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["run", "status", "exit", "turns", "tokens", "model", "tenant", "created"]
    assert rows[0].split()[:5] == [handle.run_id, "completed", "default", "1", "30"]
    assert "\x1b[" not in table.stdout and "─" not in table.stdout  # no rich in a pipe
    rows = json.loads(tooloop("list", "--json", "--limit", "5").stdout)
    mine = next(r for r in rows if r["run_id"] == handle.run_id)
    assert mine["iteration"] == 1 and mine["tenant"] == "lister" and mine["exit"] == "default"


def test_watch_replays_a_finished_run_as_plain_lines(client, worker, spec) -> None:
    handle = client.submit(spec([add_call(), {"content": "5"}], tools=["add"]))
    handle.wait(timeout=20)
    watched = tooloop("watch", handle.run_id)
    assert watched.returncode == 0, watched.stderr
    expected = [event_line(e) for e in handle.events()]
    assert watched.stdout.splitlines() == expected
    assert expected[1:] == [
        "turn 1 tool_calls=1 tokens=30",
        "turn 1 tool add success=true",
        "turn 2 tool_calls=0 tokens=60",
        "outcome exit=default status=completed turn=2",
    ]


def test_watch_follows_a_live_run_through_a_pipe(client, worker, spec, holds) -> None:
    release = gate(holds)
    handle = client.submit(spec([add_call(), {"content": "5", "hold": release}], tools=["add"]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "watch", handle.run_id],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        lines = [proc.stdout.readline().rstrip("\n") for _ in range(3)]
        assert lines[1:] == ["turn 1 tool_calls=1 tokens=30", "turn 1 tool add success=true"]
        assert handle.status() == Status.running and proc.poll() is None  # live, still watching
        release.set()
        rest, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert rest.splitlines() == [
        "turn 2 tool_calls=0 tokens=60",
        "outcome exit=default status=completed turn=2",
    ]
    assert proc.returncode == 0


def test_watch_exit_code_follows_the_outcome(client, worker, spec) -> None:
    handle = client.submit(spec([add_call()], tools=["add"], max_iterations=1))
    handle.wait(timeout=20)
    watched = tooloop("watch", handle.run_id)
    assert watched.returncode == 1
    assert watched.stdout.splitlines()[-1] == "outcome exit=max_iterations status=failed turn=1"


def test_watch_on_a_terminal_draws_with_rich(client, worker, spec) -> None:
    handle = client.submit(spec([add_call(), {"content": "5"}], tools=["add"]))
    handle.wait(timeout=20)
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "watch", handle.run_id],
        stdin=child, stdout=child, stderr=child, cwd=ROOT, env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip
    os.close(child)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 30)
            if not ready:
                break
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child side closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        proc.wait(timeout=30)
        os.close(main)
    text = out.decode(errors="replace")
    assert proc.returncode == 0
    for label in ("status", "turn", "tool calls", "tokens", "elapsed", "completed (default)", "1 (0 failed)"):
        assert label in text, text


# -- control from a second process ---------------------------------------------------------------
def test_control_commands_change_a_live_run(client, worker, spec, model_server, holds) -> None:
    release = gate(holds)
    s = spec([add_call(hold=release), {"content": "steered"}], tools=["add"])
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))  # turn 1 in flight on the worker

    paused = tooloop("pause", handle.run_id)
    assert paused.returncode == 0 and paused.stdout.strip() == f"pause: {handle.run_id} (ok)"
    assert json.loads(tooloop("status", handle.run_id, "--json").stdout)["status"] == "paused"
    steered = tooloop("steer", handle.run_id, "Prefer small numbers.")
    assert steered.returncode == 0, steered.stderr
    assert tooloop("steer", handle.run_id, "  ").returncode == 2
    release.set()
    time.sleep(1.0)
    assert handle.status() == Status.paused and len(model_server.calls(s["model"])) == 1

    assert tooloop("resume", handle.run_id).returncode == 0
    result = handle.wait(timeout=30)
    assert (result.status, result.content) == (Status.completed, "steered")
    second = model_server.calls(s["model"])[1]["messages"]
    assert any(m["role"] == "system" and "Prefer small numbers." in m["content"] for m in second)
    controls = [(e.action, e.by or "") for e in handle.events() if e.type == "control"]
    assert [a for a, by in controls if by.startswith("cli:")] == ["pause", "steer", "resume"]
    assert tooloop("pause", handle.run_id).returncode == 1  # already ended


def test_watch_shows_paused_when_the_reply_in_flight_lands_after_the_pause(client, worker, spec, model_server,
                                                                          store, holds) -> None:  # fmt: skip
    """Pause while the model answers turn 1: its `iteration` event comes after the pause's
    `control` event, and the run stays paused; the live view must say so."""
    from orchestrator.views import WatchState

    release = gate(holds)
    s = spec([add_call(hold=release), {"content": "5"}], tools=["add"])
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))  # turn 1 in flight on the worker
    assert handle.pause() == "ok"
    release.set()
    events = wait_for(lambda: [e for e in store.read_events(handle.run_id) if e.type == "iteration"]
                      and store.read_events(handle.run_id))  # fmt: skip
    assert [e.type for e in events] == ["queued", "control", "iteration"]  # the order this is about
    view = WatchState(handle.run_id)
    for event in events:
        view.apply(event)
    assert handle.status() == Status.paused and view.status == "paused"
    assert (view.turn, view.tokens) == (1, 30)  # the reply's progress is still shown
    assert handle.resume() == "ok"
    for event in list(handle.events(timeout=30))[len(events):]:
        view.apply(event)
    assert view.status == "completed (default)"


def test_abort_command_ends_a_live_run(client, worker, spec, model_server, holds) -> None:
    release = gate(holds)
    s = spec([add_call(hold=release), {"content": "never"}], tools=["add"])
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    aborted = tooloop("abort", handle.run_id, "--reason", "operator says stop")
    assert aborted.returncode == 0, aborted.stderr
    result = handle.result()
    assert (result.status, result.exit) == (Status.aborted, "aborted")
    assert "operator says stop" in result.error and "cli:" in result.error
    assert tooloop("abort", handle.run_id).returncode == 1
    assert tooloop("abort", "no-such-run").returncode == 2


# -- validate ------------------------------------------------------------------------------------
@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with one agent: agents/reviewer/{steering,skills}/."""
    (tmp_path / "agents/reviewer/steering").mkdir(parents=True)
    (tmp_path / "agents/reviewer/skills").mkdir()
    (tmp_path / "agents/reviewer/steering/style.md").write_text("Answer in one line.\n")
    (tmp_path / "agents/reviewer/skills/triage.md").write_text("Sort findings by severity.\n")
    (tmp_path / "notes.md").write_text("not an agent file\n")
    return tmp_path


def test_validate_steering_files(project, spec, model_server) -> None:
    base = spec([{"content": "x"}])
    ok = write_spec(project, {**base, "steering_files": ["agents/reviewer/steering/style.md"],
                              "skills": ["agents/reviewer/skills/triage.md"]}, "ok.json")  # fmt: skip
    done = tooloop("validate", str(ok), cwd=project)
    assert done.returncode == 0 and done.stdout.strip() == f"{ok}: ok" and "warning" not in done.stderr

    missing = write_spec(project, {**base, "steering_files": ["agents/reviewer/steering/gone.md"]}, "w.json")
    done = tooloop("validate", str(missing), cwd=project)
    assert done.returncode == 0
    assert "warning: steering_files.0: 'agents/reviewer/steering/gone.md' not found; skipped" in done.stderr

    outside = write_spec(project, {**base, "steering_files": ["notes.md"], "skills": ["../x.md"]}, "e.json")
    done = tooloop("validate", str(outside), cwd=project)
    assert done.returncode == 1
    assert "error: steering_files.0: 'notes.md'" in done.stderr and "outside the agents folder" in done.stderr
    assert "error: skills.0: '../x.md'" in done.stderr

    # TOOLOOP_AGENTS_DIR moves the folder; paths may then be written relative to it
    moved = write_spec(project, {**base, "skills": ["reviewer/skills/triage.md"]}, "m.json")
    done = tooloop("validate", str(moved), cwd=ROOT, env={"TOOLOOP_AGENTS_DIR": str(project / "agents")})
    assert done.returncode == 0, done.stderr


def test_validate_other_errors(tmp_path, spec, model_server, worker) -> None:
    unknown_tool = write_spec(tmp_path, spec([{"content": "x"}], tools=["no_such_tool"]))
    done = tooloop("validate", str(unknown_tool))
    assert done.returncode == 1 and "no_such_tool" in done.stderr
    bad_field = write_spec(tmp_path, {**spec([{"content": "x"}]), "max_iterations": 0}, "b.json")
    done = tooloop("validate", str(bad_field))
    assert done.returncode == 1 and "max_iterations" in done.stderr


def test_validate_the_example_agent() -> None:
    example = ROOT / "agents/reviewer/example-spec.yaml"
    done = tooloop("validate", str(example))
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr


def test_submit_prints_validation_warnings(project, spec, worker) -> None:
    missing = write_spec(project, {**spec([{"content": "x"}]),
                                   "steering_files": ["agents/reviewer/steering/gone.md"]})  # fmt: skip
    done = tooloop("submit", str(missing), cwd=project)
    assert done.returncode == 0 and len(done.stdout.split()) == 1  # the run id alone
    assert "warning: steering_files.0: 'agents/reviewer/steering/gone.md' not found" in done.stderr


def test_list_by_tenant_finds_a_small_tenant_among_busy_ones(client, worker, spec) -> None:
    quiet = client.submit({**spec([{"content": "q"}]), "tenant": "quiet-tenant"})
    for _ in range(8):
        client.submit({**spec([{"content": "b"}]), "tenant": "busy-tenant"})
    rows = client.list(limit=3, tenant="quiet-tenant")
    assert [r["run_id"] for r in rows] == [quiet.run_id]
    assert {r["tenant"] for r in client.list(limit=3, tenant="busy-tenant")} == {"busy-tenant"}


def test_flower_sees_the_tasks_of_a_run(client, worker, spec) -> None:
    """`tooloop flower` on this app: task events reach it; its API answers without auth set."""

    def submit() -> str:
        handle = client.submit(spec([add_call(), {"content": "5"}], tools=["add"]))
        handle.wait(timeout=30)
        return handle.run_id

    with flower() as base:
        assert once_flower_shows(submit, lambda run_id: flower_task_names(base, run_id))


def test_control_and_status_commands_do_not_import_litellm() -> None:
    """The CLI starts fast: litellm (~6 s, ~150 MB), FastAPI, the Celery worker, the tracing SDK,
    its exporters and the Prometheus client stay out."""
    probe = ("import sys\n"
             "from orchestrator.cli import app\n"
             "from typer.testing import CliRunner\n"
             "for args in (['status', 'nope'], ['pause', 'nope'], ['steer', 'nope', 'x'], ['list']):\n"
             "    CliRunner().invoke(app, args)\n"
             "heavy = ('litellm', 'fastapi', 'worker.turn', 'openai', 'opentelemetry.sdk.trace',\n"
             "         'opentelemetry.exporter', 'grpc', 'prometheus_client')\n"
             "print(sorted(m for m in heavy if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_plain_celery_worker_serves_turns_and_tools(deployment, spec) -> None:
    """`celery -A worker.app worker` (no -Q, default prefork pool) runs whole loops."""
    d = deployment()
    command = [sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-c", "2", "-l", "warning",
               "-n", f"plain@{d.prefix}"]  # fmt: skip
    celery = subprocess.Popen(command, env={**os.environ, **d.env}, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        # the worker starts as a fresh interpreter (~8 s of CPU): READY_S covers its start
        result = d.client.submit(spec([add_call(), {"content": "5"}], tools=["add"])).wait(timeout=READY_S)
        assert (result.status, result.tool_calls[0].output) == ("completed", 5)
    finally:
        celery.terminate()
        celery.wait(timeout=30)


def test_a_command_with_redis_unreachable_says_so_and_exits_1() -> None:
    from orchestrator.local import free_port

    done = tooloop("status", "some-run", "--json",
                   env={"TOOLOOP_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "error: Redis unreachable at TOOLOOP_REDIS_URL" in done.stderr and "Traceback" not in done.stderr
    error = json.loads(done.stdout)["error"]  # --json: the error is stdout's one document
    assert error["type"] == "redis_unreachable" and "TOOLOOP_REDIS_URL" in error["message"]


def test_a_worker_started_elsewhere_says_once_which_tool_module_it_cannot_find(tmp_path) -> None:
    """Failed before: from another folder, `--tools examples.tools` printed six tracebacks
    (414 lines) while the pools died and restarted, then gave up."""
    script = Path(sys.executable).with_name("tooloop")  # the console script, as a user runs it
    command = [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]
    env = {**os.environ, "TOOLOOP_TOOLS": "", "PYTHONPATH": ""}  # the suite's PYTHONPATH holds the project
    done = subprocess.run([*command, "worker", "--tools", "examples.tools"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "Traceback" not in said and "restarting" not in said and said.count("not found") == 1, said
    assert "'examples.tools'" in said and f"from the folder {tmp_path}" in said and "sys.path" in said
    assert f"\n    {tmp_path}\n" in said and "PYTHONPATH=" in said  # the pools' path, and the fix
