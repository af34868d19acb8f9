"""Record a run as a cassette, replay it offline (orchestrator/replay/): the real loop, every
model reply from the cassette, on an embedded Redis. The runs recorded here are real runs of
the session's worker against the scripted model; the replays run in this process."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
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


KINDS = ("calls", "text", "compaction", "approval", "steer", "error")


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
        "steer": make(model_server, [tools(call("add", {"a": 1, "b": 2}), delay=1.0), {"content": "ok"}],
                      tools=["add"]),
        "error": make(model_server, [tools(call("add", {"a": 1, "b": 1})), {"status": 401, "error": "bad key"}],
                      tools=["add"], model_params={"max_retries": 0}),
    }  # fmt: skip
    handles = {kind: client.submit(data) for kind, data in specs.items()}
    wait_for(lambda: model_server.calls(specs["steer"]["model"]), timeout=60)
    assert handles["steer"].steer("Prefer small numbers.") == "ok"
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
    assert (new.status, new.exit, new.iterations, new.tokens_used, new.content, new.error_type) == (
        result.status, result.exit, result.iterations, result.tokens_used, result.content, result.error_type)
    assert [(r.call_id, r.tool_name, r.inputs, r.success, r.output, r.error) for r in new.tool_calls] == [
        (r.call_id, r.tool_name, r.inputs, r.success, r.output, r.error) for r in result.tool_calls]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_run_replays_the_same(cassettes, kind):
    result, path = cassettes[kind]
    assert result.status.ended
    same_run(replay(path), result)


def test_what_the_recorded_runs_did(cassettes, store):
    """The recordings hold what each kind of run is about (else `same` would prove little)."""
    calls = cassettes["calls"][0]
    assert [r.success for r in calls.tool_calls] == [True, False, False, False]
    assert [r.error.split(":")[0] for r in calls.tool_calls[1:]] == ["RuntimeError", "ValidationError", "UnknownTool"]
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
    assert (first.iteration, first.what, first.recorded["arguments"]) == (1, "tool_arguments", {"a": 2, "b": 3})
    assert "c: Field required" in first.now["error"]
