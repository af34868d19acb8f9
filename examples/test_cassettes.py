"""Recorded runs as regression tests: one test per cassette in examples/cassettes/.

    pytest examples/test_cassettes.py                 # tool results from the cassettes
    TOOLOOP_REPLAY_TOOLS=live pytest examples/...     # run the tools again too

Each cassette is an ended run (`tooloop record RUN -o examples/cassettes/NAME.jsonl`). A replay
runs the real loop offline, every model reply served from the cassette: no Redis server, no
provider key, no model bill. It fails where the run would now part from the recording: a prompt
or steering file that changed what the model is asked, a tool gone or whose schema refuses the
recorded arguments, a tool result that changed (live), another exit. To re-record after a
change you mean: run the agent again for real, look at its result, and record it over the old
cassette (docs/replay.md). The tools these cassettes call are tooloop's built-ins; a project's
own come from TOOLOOP_TOOLS, as a worker's do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.testing import replay

CASSETTES = sorted((Path(__file__).parent / "cassettes").glob("*.jsonl"))


@pytest.mark.parametrize("path", CASSETTES, ids=lambda path: path.stem)
def test_the_recorded_run_still_behaves(path: Path) -> None:
    report = replay(path, tools=os.environ.get("TOOLOOP_REPLAY_TOOLS", "recorded"))
    assert report.same, "\n".join(f"{d.describe()}: {d.recorded!r} -> {d.now!r}" for d in report.divergences)
