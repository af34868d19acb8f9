"""Record a run as a cassette, replay it offline (orchestrator/replay/): the real loop, every
model reply from the cassette, on an embedded Redis. The runs recorded here are real runs of
the session's worker against the scripted model; the replays run in this process."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orchestrator import Status
from orchestrator.replay.cassette import dumps, load
from orchestrator.replay.record import RecordError, record
from orchestrator.testing import replay
from tests.helpers import call, tools, wait_for
from tests.test_compaction import counter
from tests.tools import LEAKED
from worker.registry import REGISTRY


def make(model_server, steps: list, **fields: Any) -> dict[str, Any]:
    model = model_server.script(steps)
    params = {"api_base": model_server.api_base, **fields.pop("model_params", {})}
    return {"prompt": "do the task", "model": model, "model_params": params, **fields}


def save(store, run_id: str, folder: Path, name: str) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text(dumps(record(store, run_id)))
    return path


KINDS = ("calls", "text", "compaction", "approval", "steer", "error", "aborted")


@pytest.fixture(scope="module")
def cassettes(client, worker, model_server, store, tmp_path_factory) -> dict[str, tuple[Any, Path]]:
    """One recorded run of each kind, run side by side: (its result, its cassette)."""
    specs = {
        "calls": make(model_server, [
            tools(call("add", {"a": 2, "b": 3}), call("boom", {"message": "kaput"})),
            tools(call("add", {"a": "x"})),  # refused by the schema
            tools(call("nope", {})),  # not a tool of the run
            {"content": "five"},
        ], tools=["add", "boom"]),
        "text": make(model_server, [
            {"content": 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'},
            {"content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": }</tool_call>'},  # corrected
            {"content": "5"},
        ], tools=["add"]),
        "compaction": make(model_server, [counter(7, pad=800)], tools=["count"], context_tokens=1000),
        "approval": make(model_server, [
            tools(call("guarded_append", {"text": "ship it"}, call_id="g1"),
                  call("guarded_append", {"text": "drop tables"}, call_id="g2")),
            {"content": "done"},
        ], tools=["guarded_append"]),
        "steer": make(model_server, [tools(call("add", {"a": 1, "b": 2}), hold=(asked := threading.Event())),
                                     {"content": "ok"}], tools=["add"]),
        "error": make(model_server, [tools(call("add", {"a": 1, "b": 1})),
                                     {"status": 401, "error": "bad key"}],
                      tools=["add"], model_params={"max_retries": 0}),
        "aborted": make(model_server, [tools(call("add", {"a": 1, "b": 1})),
                                       {"content": "never", "hold": (held := threading.Event())}],
                        tools=["add"]),
    }  # fmt: skip
    handles = {kind: client.submit(data) for kind, data in specs.items()}
    wait_for(lambda: len(model_server.calls(specs["aborted"]["model"])) == 2, timeout=60)
    assert handles["aborted"].abort(reason="enough") == "ok"
    held.set()  # the scripted model answers; the reply is discarded
    wait_for(lambda: model_server.calls(specs["steer"]["model"]), timeout=60)
    assert handles["steer"].steer("Prefer small numbers.") == "ok"
    asked.set()  # turn 1's reply, once the steer waits for turn 2
    waiting = handles["approval"]
    wait_for(lambda: len(waiting.pending_approvals()) == 2, timeout=60)
    assert waiting.approve("g1") == "ok" and waiting.deny("g2", reason="not on a Friday") == "ok"
    folder = tmp_path_factory.mktemp("cassettes")
    out = {}
    for kind, handle in handles.items():
        result = handle.wait(timeout=120)
        out[kind] = (result, save(store, handle.run_id, folder, kind))
    return out


def same_run(report, result) -> None:
    assert report.same, report.divergences
    new = report.result
    assert (new.status, new.exit, new.iterations, new.content, new.error_type) == (
        result.status, result.exit, result.iterations, result.content, result.error_type)
    if result.exit != "aborted":  # an aborted run's discarded reply was billed; no cassette holds it
        assert new.tokens_used == result.tokens_used
    def calls(run):
        return [(r.call_id, r.tool_name, r.inputs, r.success, r.output, r.error) for r in run.tool_calls]

    assert calls(new) == calls(result)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_run_replays_the_same(cassettes, kind):
    result, path = cassettes[kind]
    assert result.status.ended
    same_run(replay(path), result)


def test_what_the_recorded_runs_did(cassettes, store):
    """The recordings hold what each kind of run is about (else `same` would prove little)."""
    calls = cassettes["calls"][0]
    assert [r.success for r in calls.tool_calls] == [True, False, False, False]
    errors = [r.error.split(":")[0] for r in calls.tool_calls[1:]]
    assert errors == ["RuntimeError", "ValidationError", "UnknownTool"]
    text = load(cassettes["text"][1])
    assert "<tool_call>" in text.turns[1]["reply"]["content"]  # the reply as received, not as stored
    compacted = load(cassettes["compaction"][1])
    assert cassettes["compaction"][0].tokens_compaction > 0
    assert any(line["compactions"] for line in compacted.turns.values())
    approval = load(cassettes["approval"][1])
    assert [approval.calls[k]["approval"]["decision"] for k in ("1.0", "1.1")] == ["approved", "denied"]
    assert approval.calls["1.1"]["record"]["error"] == "Denied: not on a Friday"
    steered = load(cassettes["steer"][1])
    assert steered.turns[2]["steers"] == ["Prefer small numbers."]
    error = cassettes["error"][0]
    assert (error.exit, error.error_type) == ("error", "AuthenticationError")


@pytest.fixture
def note() -> Iterator[Path]:
    """A world-readable file outside any run folder (the sandbox's own uid may read it)."""
    folder = Path(tempfile.mkdtemp(prefix="tooloop-note-"))
    folder.chmod(0o755)
    path = folder / "note.txt"
    path.write_text("v1")
    path.chmod(0o644)
    yield path
    shutil.rmtree(folder, ignore_errors=True)


def test_a_changed_tool_output_is_found_live(client, worker, spec, store, note, tmp_path):
    steps = [tools(call("read_note", {"path": str(note)})), tools(call("add", {"a": 1, "b": 1})),
             {"content": "read"}]  # fmt: skip
    handle = client.submit(spec(steps, tools=["read_note", "add"]))
    result = handle.wait(timeout=60)
    assert result.tool_calls[0].output == "v1"
    path = save(store, handle.run_id, tmp_path, "live")
    same_run(replay(path, tools="live"), result)  # the tools ran again, and gave the same results
    note.write_text("v2")
    assert replay(path).same  # recorded results: the file is not read
    report = replay(path, tools="live")
    assert not report.same and report.result.status == Status.aborted  # stopped there
    [first] = report.divergences
    assert (first.iteration, first.what, first.recorded["output"], first.now["output"]) == (
        1, "tool_result", "v1", "v2")  # fmt: skip
    assert first.now["call"] == "1.0" and first.now["tool"] == "read_note"
    # with keep_going the recorded replies go on: the next request differs too (the model read v2)
    going = replay(path, tools="live", keep_going=True)
    assert [(d.iteration, d.what) for d in going.divergences] == [(1, "tool_result"), (2, "request")]
    assert (going.divergences[1].recorded["text"], going.divergences[1].now["text"]) == ("v1", "v2")
    assert going.result.status == Status.completed and going.result.iterations == 3


def test_a_removed_tool_is_found(cassettes, monkeypatch):
    _, path = cassettes["calls"]
    monkeypatch.delitem(REGISTRY, "boom")
    report = replay(path)
    assert [(d.iteration, d.what) for d in report.divergences] == [(1, "tool_missing")]
    assert report.divergences[0].now == {"call": "1.1", "tool": "boom", "exists": False}


def test_a_schema_that_refuses_the_recorded_arguments_is_found(cassettes, monkeypatch):
    from pydantic import create_model

    _, path = cassettes["calls"]
    stricter = create_model("add_args", a=(int, ...), b=(int, ...), c=(int, ...))
    monkeypatch.setitem(REGISTRY, "add", dataclasses.replace(REGISTRY["add"], arguments=stricter))
    [first] = replay(path).divergences
    assert (first.iteration, first.what) == (1, "tool_arguments")
    assert first.recorded["arguments"] == {"a": 2, "b": 3}
    assert "c: Field required" in first.now["error"]


def test_a_changed_steering_file_is_found(client, worker, spec, store, tmp_path, monkeypatch):
    style = tmp_path / "agents/reviewer/steering/style.md"
    style.parent.mkdir(parents=True)
    style.write_text("Answer in one line.\n")
    monkeypatch.chdir(tmp_path)  # steering files are read from the submitter's (and the replay's) cwd
    steps = [tools(call("add", {"a": 1, "b": 2})), {"content": "3"}]
    handle = client.submit(spec(steps, tools=["add"], steering_files=["agents/reviewer/steering/style.md"]))
    result = handle.wait(timeout=60)
    path = save(store, handle.run_id, tmp_path, "steered")
    same_run(replay(path), result)
    style.write_text("Answer in two lines.\n")
    [first] = replay(path).divergences
    assert (first.iteration, first.what) == (1, "request")
    assert (first.recorded["message"], first.recorded["role"], first.now["role"]) == (0, "system", "system")
    assert "Answer in one line." in first.recorded["text"] and "Answer in two lines." in first.now["text"]


def test_a_changed_prompt_is_found_and_the_cli_says_so(cassettes, tmp_path):
    from orchestrator.cli import app

    _, path = cassettes["calls"]
    recorded_spec = load(path).spec
    report = replay(path, spec={**recorded_spec, "prompt": "do another task"})
    [first] = report.divergences
    assert (first.iteration, first.what, first.recorded, first.now) == (
        1, "request", {"message": 1, "role": "user", "text": "do the task"},
        {"message": 1, "role": "user", "text": "do another task"})  # fmt: skip
    # the CLI: the same replay, a spec file given; one JSON document, exit 1 (0 when same)
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps({**recorded_spec, "prompt": "do another task"}))
    runner = CliRunner()
    out = runner.invoke(app, ["replay", str(path), "--spec", str(changed), "--json"])
    assert out.exit_code == 1, out.output
    document = json.loads(out.stdout)
    assert document["same"] is False and document["divergences"][0]["now"]["text"] == "do another task"
    same = runner.invoke(app, ["replay", str(path)])
    assert same.exit_code == 0 and same.stdout.startswith("same:"), same.output
    refused = runner.invoke(app, ["replay", str(tmp_path / "missing.jsonl"), "--json"])
    assert refused.exit_code == 2 and json.loads(refused.stdout)["error"]["type"] == "cassette_refused"


def test_a_different_exit_is_found(cassettes):
    _, path = cassettes["calls"]
    spec = {**load(path).spec, "max_iterations": 2}  # not part of any request
    report = replay(path, spec=spec)
    [first] = report.divergences
    assert (first.what, first.recorded["exit"], first.now["exit"]) == ("exit", "default", "max_iterations")
    assert report.result.exit == "max_iterations"


def test_a_cassette_holds_no_secret(client, worker, spec, store, model_server, tmp_path):
    """Every place a secret can enter a run: a sealed key, a header, a binding, a tool's output,
    a call's arguments, the model's own text and the prompt."""
    text = f"token={LEAKED['github']}"
    steps = [tools(call("leaky"), call("fingerprint", {"text": text})),
             {"content": f"Done. The key was {LEAKED['api_key']}, aws {LEAKED['aws']}."}]  # fmt: skip
    params = {"api_key": "sk-own-secret-key-1234", "extra_headers": {"X-Api-Key": "hdr-secret-2"}}
    bindings = {"db": f"postgres://app:{LEAKED['password']}@db/app"}
    data = spec(steps, tools=["leaky", "fingerprint"], prompt=f"use password={LEAKED['password']}",
                model_params=params, context={"resource_bindings": bindings})
    handle = client.submit(data)
    assert handle.wait(timeout=60).status == Status.completed
    path = save(store, handle.run_id, tmp_path, "secrets")
    blob = path.read_text()
    hunted = [*LEAKED.values(), "sk-own-secret-key-1234", "hdr-secret-2", "sealed:"]
    assert [s for s in hunted if s in blob] == []
    assert "fingerprint" in blob and "leaky" in blob  # the calls are there, their secrets masked
    assert replay(path).same  # and it replays, masked


def test_only_an_ended_run_is_recorded(client, worker, spec, store, holds, tmp_path):
    from orchestrator.cli import app
    from tests.helpers import gate

    handle = client.submit(spec([{"content": "later", "hold": gate(holds)}]))
    wait_for(lambda: handle.status() == Status.running)
    with pytest.raises(RecordError, match="only an ended run can be recorded") as refused:
        record(store, handle.run_id)
    assert refused.value.kind == "running"
    out = CliRunner().invoke(app, ["record", handle.run_id, "-o", str(tmp_path / "x.jsonl"), "--json"])
    assert out.exit_code == 2 and json.loads(out.stdout)["error"]["type"] == "running"
    assert not (tmp_path / "x.jsonl").exists()
    missing = CliRunner().invoke(app, ["record", "no-such-run", "-o", str(tmp_path / "y.jsonl")])
    assert missing.exit_code == 2
    holds[0].set()
    handle.wait(timeout=60)
    done = CliRunner().invoke(app, ["record", handle.run_id, "-o", str(tmp_path / "x.jsonl"), "--json"])
    assert done.exit_code == 0 and json.loads(done.stdout)["turns"] == 1
    assert replay(tmp_path / "x.jsonl").same


def test_a_forks_cassette_replays_from_where_it_was_forked(client, worker, spec, store, model_server,
                                                           tmp_path):  # fmt: skip
    steps = [tools(call("add", {"a": 1, "b": 2})), tools(call("add", {"a": 3, "b": 4})), {"content": "7"}]
    parent = client.submit(spec(steps, tools=["add"]))
    parent.wait(timeout=60)
    other = model_server.script([{"content": "never"}, {"content": "never"}, {"content": "seven"}])
    fork = parent.fork(at=3, prompt_append="Say it in words.", model=other)
    result = fork.wait(timeout=60)
    assert result.content == "seven"
    path = save(store, fork.run_id, tmp_path, "fork")
    cassette = load(path)
    assert cassette.header["start"]["iteration"] == 3 and sorted(cassette.turns) == [3]
    assert cassette.header["start"]["messages"][-1] == {"role": "user", "content": "Say it in words."}
    report = replay(path)
    same_run(report, result)
    assert report.result.forked_from == result.forked_from


def test_the_example_cassettes_replay_the_same():
    """examples/cassettes: what users copy, kept honest (tooloop's built-in tools, live too)."""
    from examples.test_cassettes import CASSETTES

    assert {p.stem for p in CASSETTES} == {"notes", "review"}
    for path in CASSETTES:
        for tools_mode in ("recorded", "live"):
            report = replay(path, tools=tools_mode)
            assert report.same, (path.stem, tools_mode, report.divergences)
    assert replay(CASSETTES[1]).result.exit == "approved"


def test_a_run_without_its_journal_is_still_recorded_and_forked(client, worker, spec, store, tmp_path):
    """A run from before the journal (or whose worker died between a reply and its entry): its
    replies come from the history, its tokens before a turn from its events."""
    steps = [tools(call("add", {"a": 2, "b": 3})), tools(call("add", {"a": 5, "b": 5})), {"content": "ten"}]
    handle = client.submit(spec(steps, tools=["add"]))
    result = handle.wait(timeout=60)
    store.redis.delete(store.keys.journal(handle.run_id))
    path = save(store, handle.run_id, tmp_path, "unjournaled")
    cassette = load(path)
    assert [cassette.turns[n]["request"] for n in (1, 2, 3)] == [None, None, None]
    assert cassette.turns[3]["reply"]["content"] == "ten"
    same_run(replay(path), result)
    fork = handle.fork(at=3)
    forked = fork.wait(timeout=60)
    assert (forked.content, forked.tokens_used) == ("ten", result.tokens_used)


def test_a_refused_reply_is_kept_cut_and_served_at_its_size_again():
    """A reply too large to keep (the run ends ReplyTooLarge) is journaled as a cut copy and
    its size, never whole; a replay serves it at that size, so the run refuses it again."""
    from orchestrator.bounds import ERROR_MAX_CHARS, REPLY_MAX_CHARS
    from orchestrator.journal import received
    from orchestrator.replay.server import body
    from worker.protect import oversized, reply_chars

    arguments = '{"a": 1}' + " " * 60_000
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    kept = received({"content": "z" * 5_000_000, "tool_calls": [call]})
    assert kept["oversize"] == 5_060_008 and len(json.dumps(kept)) < 3 * ERROR_MAX_CHARS
    served = body(kept, "m")["choices"][0]["message"]
    assert reply_chars(served) == 5_060_008 and oversized(served).error_type == "ReplyTooLarge"
    normal = received({"content": "y" * REPLY_MAX_CHARS})  # at the bound: kept whole
    assert "oversize" not in normal and len(normal["content"]) == REPLY_MAX_CHARS
