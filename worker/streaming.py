"""Live model text: a streamed reply's deltas, paced, scrubbed, to the run's event stream.

With ``model_params.stream: true`` the model call hands every text delta to a
``TextStream``. Watchers (``tooloop watch``, the API's SSE, ``RunHandle.events()``)
read the run's event stream, so the text goes there as ``text`` events, and nowhere
else: the stream is capped (``TOOLOOP_EVENTS_MAXLEN``) and expires with the run.

Pacing: a piece is sent once at least ``MIN_CHARS`` are buffered and at least
``MIN_INTERVAL_S`` have passed since the last one (a timer sends it if the model
pauses); the end of the reply sends what is left (it may be shorter), still no
sooner than ``MIN_INTERVAL_S`` after the previous piece. Each piece ends at a
whitespace, so a token is never split between two pieces, and is scrubbed together
with the end of the previous piece, so a ``password: ...`` pair that straddles two
pieces is still masked.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

from orchestrator.scrub import continued, tail_words

log = logging.getLogger(__name__)

MIN_CHARS = 80
MIN_INTERVAL_S = 0.5
MAX_HOLD_CHARS = 4_000  # a run of text without whitespace this long is cut anyway
_LAST_SPACE = re.compile(r"\s(?=\S*$)")

Sink = Callable[[str], None]  # sends one piece (already scrubbed)


class TextStream:
    """The ``on_text`` callback of one model call; ``""`` marks the end of the reply."""

    def __init__(self, sink: Sink, clock: Callable[[], float] = time.monotonic) -> None:
        self.sink, self.clock = sink, clock
        self.pending = ""  # received, not sent yet
        self.context = ""  # the end of what was sent, scrubbed
        self.last_sent = float("-inf")
        self.timer: asyncio.TimerHandle | None = None

    async def __call__(self, delta: str) -> None:
        if delta:
            self.pending += delta
            self._send_due()
            return
        self._cancel_timer()
        if self.pending:
            await asyncio.sleep(max(0.0, self.last_sent + MIN_INTERVAL_S - self.clock()))
            self._send(len(self.pending))

    def _send_due(self) -> None:
        cut = self._cut()
        if cut < MIN_CHARS:
            return
        wait = self.last_sent + MIN_INTERVAL_S - self.clock()
        if wait <= 0:
            self._send(cut)
        elif self.timer is None:  # the model may pause: send what is due without the next delta
            self.timer = asyncio.get_running_loop().call_later(wait, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        self._send_due()

    def _cut(self) -> int:
        """How much of ``pending`` may go now: up to its last whitespace."""
        if len(self.pending) >= MAX_HOLD_CHARS:
            return len(self.pending)
        match = _LAST_SPACE.search(self.pending)
        return match.start() + 1 if match else 0

    def _send(self, cut: int) -> None:
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        text = continued(self.context, piece)
        self.context = tail_words(self.context + text)
        try:
            self.sink(text)
        except Exception:  # a watcher's view is not worth the turn
            log.warning("streamed text not published", exc_info=True)
        finally:  # after the write: a slow write must not shorten the gap to the next one
            self.last_sent = self.clock()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

