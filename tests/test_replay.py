"""Record a run as a cassette, replay it offline (orchestrator/replay/): the real loop, every
model reply from the cassette, on an embedded Redis. The runs recorded here are real runs of
the session's worker against the scripted model; the replays run in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import Status
from orchestrator.replay.cassette import dumps
from orchestrator.replay.record import RecordError, record
from orchestrator.testing import replay
from tests.conftest import ROOT
from tests.helpers import call, gate, tools, wait_for
from tests.tools import LEAKED


def recorded(store, handle, tmp_path: Path, name: str = "run") -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text(dumps(record(store, handle.run_id)))
    return path


def test_a_run_with_tool_calls_and_failed_calls_replays_the_same(client, worker, spec, store, tmp_path):
    steps = [
        tools(call("add", {"a": 2, "b": 3}), call("boom", {"message": "kaput"})),
        tools(call("add", {"a": "x"})),  # refused by the schema: a failed record
        tools(call("nope", {})),  # not a tool of the run
        {"content": "five"},
    ]
    handle = client.submit(spec(steps, tools=["add", "boom"]))
    result = handle.wait(timeout=60)
    assert result.status == Status.completed and len(result.tool_calls) == 4
    path = recorded(store, handle, tmp_path)
    report = replay(path)
    assert report.same, report.divergences
    assert (report.result.exit, report.result.iterations, report.result.tokens_used) == (
        result.exit, result.iterations, result.tokens_used)  # fmt: skip
    assert [(r.tool_name, r.success, r.output, r.error) for r in report.result.tool_calls] == [
        (r.tool_name, r.success, r.output, r.error) for r in result.tool_calls]  # fmt: skip
