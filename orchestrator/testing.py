"""Replay recorded runs as regression tests (docs/replay.md).

::

    from orchestrator.testing import replay

    def test_review_still_behaves():
        assert replay("tests/cassettes/review.jsonl").same

``replay(path, tools="recorded")`` runs the cassette's loop again, in this process, on an
embedded Redis, every model reply served from the cassette: no Redis server, no provider
key, no model bill. ``tools="live"`` runs the tools too (in a sandbox folder of its own).
The ``ReplayReport`` says whether anything differs (``same``), where (``divergences``: the
turn, what, the recorded value and the new one) and holds the new ``RunResult``.
"""

from __future__ import annotations

from orchestrator.replay.report import Divergence, ReplayReport
from orchestrator.replay.runner import ReplayError, replay

__all__ = ["Divergence", "ReplayError", "ReplayReport", "replay"]
