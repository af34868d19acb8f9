"""Live model text: a streamed reply's deltas, paced, scrubbed, to the run's event stream.

With ``model_params.stream: true`` the model call hands every text delta to a
``TextStream``. Watchers (``tooloop watch``, the API's SSE, ``RunHandle.events()``)
read the run's event stream, so the text goes there as ``text`` events, and nowhere
else: the stream is capped (``TOOLOOP_EVENTS_MAXLEN``) and expires with the run.

Pacing: a piece is sent once at least ``MIN_CHARS`` are buffered and at least
``MIN_INTERVAL_S`` have passed since the last one was written (a timer sends it if
the model pauses); the end of the reply sends what is left (it may be shorter),
still no sooner than ``MIN_INTERVAL_S`` after the previous piece. Each piece ends at
a whitespace, so a token is never split between two pieces, and is scrubbed together
with the end of the previous piece, so a ``password: ...`` pair that straddles two
pieces is still masked. Text without whitespace (minified JSON, base64) is cut past
``MAX_HOLD_CHARS`` where no secret runs across (``orchestrator.scrub.cut``); a secret
that runs on to the end of what was received is held until it ends (at most
``HOLD_SECRET_CHARS``; past that it is sent masked, and the rest of it is dropped).

Off the loop: the stream runs on the process's event loop, beside every model call
in flight there, so it never writes to Redis itself. A ``TextWriter`` (one thread
per process and store) writes the pieces, a batch per round trip. Each stream has
at most one piece on its way (the next one waits, buffered, for it to be written);
past ``PENDING_MAX`` pieces waiting in the process a piece is dropped, and the end
of a reply waits at most ``DRAIN_S`` for its text. A slow or unreachable Redis thus
costs watchers some text, never the model calls a stall of the loop would hold up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from orchestrator.scrub import SHORT_MASK, continued, cut, runs_on, tail_words, value_run

log = logging.getLogger(__name__)

MIN_CHARS = 80
MIN_INTERVAL_S = 0.5
MAX_HOLD_CHARS = 4_000  # a run of text without whitespace this long is cut anyway
HOLD_SECRET_CHARS = 65_536  # a masked secret running on to the end of the text is held this long
PENDING_MAX = 1_000  # pieces waiting to be written, per process; past it a piece is dropped
BATCH_MAX = 200  # pieces written in one round trip
DRAIN_S = 2.0  # how long the end of a reply waits for its text to be written
_LAST_SPACE = re.compile(r"\s(?=\S*$)")

Written = concurrent.futures.Future  # done once the piece is written (or given up)
# Sends one piece (already scrubbed) without blocking: a future when it is written elsewhere,
# None when it is written (or dropped) already.
Sink = Callable[[str], "Written | None"]


class TextStream:
    """The ``on_text`` callback of one model call; ``""`` marks the end of the reply."""

    def __init__(self, sink: Sink, clock: Callable[[], float] = time.monotonic) -> None:
        self.sink, self.clock = sink, clock
        self.pending = ""  # received, not sent yet
        self.context = ""  # the end of what was sent, scrubbed
        self.last_sent = float("-inf")  # when the last piece was written
        self.timer: asyncio.TimerHandle | None = None
        self.writing: asyncio.Future | None = None  # the piece on its way, if any
        self.masking = False  # the last piece ended inside a masked secret: drop the rest of it
        self.held = 0  # > 0: ``pending`` ends in a secret that may go on (its length then)

    async def __call__(self, delta: str) -> None:
        if delta:
            self.pending += delta
            self._send_due()
            return
        self._cancel_timer()
        if not await self._written():
            return
        if self.pending:
            await asyncio.sleep(max(0.0, self.last_sent + MIN_INTERVAL_S - self.clock()))
            self._send(len(self.pending))
            await self._written()  # the reply's text before the reply's record, if it can

    def _send_due(self) -> None:
        if self.writing is not None or len(self.pending) < MIN_CHARS:
            return  # (a piece on its way: the next is sent once it is written, ``_on_written``)
        wait = self.last_sent + MIN_INTERVAL_S - self.clock()
        if wait > 0:  # where to cut is worked out once a piece may go, not at every delta
            if self.timer is None:  # the model may pause: send what is due without the next delta
                self.timer = asyncio.get_running_loop().call_later(wait, self._on_timer)
            return
        cut = self._cut()
        if cut >= MIN_CHARS:
            self._send(cut)

    def _on_timer(self) -> None:
        self.timer = None
        self._send_due()

    def _cut(self) -> int:
        """How much of ``pending`` may go now: up to its last whitespace; past MAX_HOLD_CHARS
        without one, where no secret runs across (a secret still running is held)."""
        if len(self.pending) < MAX_HOLD_CHARS:
            match = _LAST_SPACE.search(self.pending)
            return match.start() + 1 if match else 0
        size, since = len(self.pending), self.pending[self.held :]
        if self.held and size < HOLD_SECRET_CHARS and value_run(since) == len(since):
            self.held = size  # the secret held goes on (none of what came since can end it)
            return 0
        at, self.held = cut(self.pending, 0, size), 0
        if at < size or size >= HOLD_SECRET_CHARS or not runs_on(self.pending):
            return at
        self.held = size  # the secret at its end may go on: wait for the rest of it
        return 0

    def _send(self, at: int) -> None:
        piece, self.pending, self.held = self.pending[:at], self.pending[at:], 0
        if self.masking:  # the rest of a secret sent masked already
            rest = value_run(piece)
            piece, self.masking = piece[rest:], rest == len(piece)
        text = continued(self.context, piece)
        self.context = tail_words(self.context + text)
        # sent past HOLD_SECRET_CHARS while a masked secret ran on: the rest of it is dropped
        ran_on = text.endswith(SHORT_MASK) and value_run(piece[-1:]) == 1
        self.masking = self.masking or ran_on
        if not text:
            return  # all of it was the rest of a masked secret
        try:
            written = self.sink(text)
        except Exception:  # a watcher's view is not worth the turn
            log.warning("streamed text not published", exc_info=True)
            written = None
        if written is None:
            self.last_sent = self.clock()
            return
        self.writing = asyncio.wrap_future(written)
        self.writing.add_done_callback(self._on_written)

    def _on_written(self, done: asyncio.Future) -> None:
        # after the write: a slow write must not shorten the gap to the next one
        self.writing, self.last_sent = None, self.clock()
        if not done.cancelled() and done.exception() is not None:
            log.warning("streamed text not published: %s", done.exception())
        self._send_due()

    async def _written(self) -> bool:
        """Wait (at most ``DRAIN_S``) for the piece on its way; False if it is still not
        written: the rest of the reply's text is dropped."""
        if self.writing is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.writing), DRAIN_S)
        except TimeoutError:
            log.warning("streamed text not written within %.0fs: the rest of this reply's is dropped",
                        DRAIN_S)  # fmt: skip
            self.pending = ""
            return False
        except Exception:  # written and failed: logged by _on_written
            pass
        return True

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class TextWriter:
    """Writes the pieces of every stream of this process from a thread of its own, a batch
    per round trip; ``send`` never blocks (see the module docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.queue: queue.Queue[tuple[str, int, str, Written] | None] = queue.Queue(PENDING_MAX)
        self.dropped = 0
        self._pid = 0
        self._lock = threading.Lock()

    def sink(self, run_id: str, iteration: int) -> Sink:
        return lambda text: self.send(run_id, iteration, text)

    def send(self, run_id: str, iteration: int, text: str) -> Written | None:
        """Queue one piece: its future, or None when it was dropped (too many waiting)."""
        self._ensure_thread()
        written: Written = concurrent.futures.Future()
        try:
            self.queue.put_nowait((run_id, iteration, text, written))
        except queue.Full:
            self.dropped += 1
            if self.dropped % 100 == 1:
                log.warning("streamed text dropped: %d pieces wait to be written (%d dropped so far)",
                            PENDING_MAX, self.dropped)  # fmt: skip
            return None
        return written

    def close(self) -> None:
        """Stop the thread once what is queued is written (a test's writer)."""
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():  # again in a forked child: threads do not survive a fork
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="tooloop-text", daemon=True).start()

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < BATCH_MAX and batch[-1] is not None:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            pieces = [item for item in batch if item is not None]
            self._write(pieces)
            if len(pieces) < len(batch):
                return

    def _write(self, pieces: list[tuple[str, int, str, Written]]) -> None:
        try:
            results: list[Any] = self.store.text_events([(r, i, t) for r, i, t, _ in pieces])
        except Exception as exc:  # Redis away: these pieces are lost, the next batch tries again
            results = [exc] * len(pieces)
        for (*_, written), result in zip(pieces, results, strict=True):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if isinstance(result, Exception):
                    written.set_exception(result)
                else:
                    written.set_result(bool(result))


_writers: dict[int, TextWriter] = {}


def writer(store: Any) -> TextWriter:
    """The process's writer for ``store`` (one thread each)."""
    found = _writers.get(id(store))
    if found is None or found.store is not store:
        found = _writers[id(store)] = TextWriter(store)
    return found


def live_text(store: Any, run_id: str, iteration: int) -> TextStream:
    """The text stream of one turn's model call, to the run's event stream."""
    return TextStream(writer(store).sink(run_id, iteration))
