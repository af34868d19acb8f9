"""Child runs, the worker's side (the state and the script: orchestrator/children.py).

The turn stores a call of ``agent__<name>`` marked with its agent (``worker/calls.py``).
``ChildCall`` handles one delivery of such a call, wherever it comes from:

- no child yet: the child's spec is built from the parent's stored spec (the call's
  prompt, masked where it holds a secret; budgets no larger than what is left of the
  parent's), ``START_CHILD`` writes the child and parks the call in one step, and the
  child's first turn is sent. The parent then waits holding no worker slot and no lease.
- the child still runs (a message sent again: a duplicate, a re-check): parked again.
- the child ended: the call is recorded from its result (``output``: its ``result`` if
  it ended on an outcome, else its ``content``; a reserved exit is a failed record whose
  ``error`` names it), and the parent's next turn is sent once its turn's calls are all in.

No tool worker is needed on the way: the parent's turn starts its children itself
(``start_now``), and whoever ends a child records the parent's call (``hand_off``).
Either may be lost with its process: the call's message is then missing from its
queue (it was never sent), or the call is due within a lease (the child's end made it
so, in the same step); the sweeper sends it to the tools queue, and the tool task
hands it to ``ChildCall``, which does the same.
"""

from __future__ import annotations

import json
from typing import Any

from celery.utils.log import get_task_logger

from orchestrator import children, fairshare
from orchestrator.models import AGENT_TOOL_PREFIX, RESERVED_EXITS, Exit, RunSpec
from orchestrator.secrets import SecretError
from orchestrator.store import RunStore, parse_spec
from worker import calls, protect
from worker.app import enqueue_turn

log = get_task_logger(__name__)


def is_child_call(message: dict[str, Any]) -> bool:
    """A tool message naming a child agent's tool (the stored call decides: see ChildCall)."""
    return str(message.get("tool") or "").startswith(AGENT_TOOL_PREFIX)


def start_now(store: RunStore, payload: dict[str, Any], celery_app: Any = None) -> None:
    """The turn that asked for a call of a child agent starts the child itself, sparing a
    hop; if that fails (or the process dies first), the call's message was never sent, so
    the sweeper finds it missing and sends it to a tool worker (``ChildCall``)."""
    try:
        ChildCall(store, {**calls.message(payload)}, 1, celery_app).run()
    except Exception:
        log.warning("child call %s/%s: not started here; the sweeper will send it", payload["run_id"],
                    payload["key"], exc_info=True)  # fmt: skip


def hand_off(store: RunStore, run_id: str, celery_app: Any = None) -> None:
    """``run_id`` ended: if it is a child whose parent's call waits, record that call now,
    here (the call is due within a lease otherwise, and the sweeper sends it); under fair
    share, its tenant's slot goes to a waiting run (orchestrator/fairshare.py)."""
    fairshare.moved(store, run_id, "end", celery_app)
    try:
        message = children.parent_call(store, run_id)
        if message is not None:
            ChildCall(store, message, None, celery_app).run()
    except Exception:  # never fail the ender: the sweeper covers it
        log.warning("run %s: its parent's call not recorded here; the sweeper will", run_id, exc_info=True)


class ChildCall:
    """One delivery of a call of a child agent (see the module docstring)."""

    def __init__(self, store: RunStore, message: dict[str, Any], gen: int | None,
                 celery_app: Any = None) -> None:  # fmt: skip
        """``gen`` None: act at the call's current generation (the child's ender, recording)."""
        self.store, self.celery = store, celery_app
        self.gen = -1 if gen is None else gen
        self.parent, self.key = str(message["run_id"]), str(message["key"])
        self.tool = str(message.get("tool") or "")
        self.child = children.child_id(self.parent, self.key)

    def run(self) -> bool:
        """False when the call is not one of a child agent (a tool named ``agent__...`` the
        spec does not declare): the tool task records it as any unknown tool."""
        look = children.look(self.store, self.parent, self.key, self.child)
        payload = look.payload or {}
        if payload.get("tool") == self.tool and not payload.get("agent"):
            return False
        if self.gen < 0:
            self.gen = look.call_gen
        why = self._stale(look)
        if why:
            log.debug("child call %s/%s skipped: %s", self.parent, self.key, why)
            return True
        assert look.payload is not None
        spec = parse_spec(look.spec_json)
        if look.child:
            self._child_there(look, spec)
        elif look.started:  # it started one, which is gone (expired, deleted)
            self._fail(spec, look.payload, f"ChildRunGone: child run {self.child} no longer exists")
        else:
            self._start(look, spec)
        return True

    def _stale(self, look: children.Look) -> str:
        """Why this delivery does nothing ('' : it acts). START_CHILD checks again, atomically."""
        if not look.status or look.status in ("completed", "failed", "aborted"):
            return "run ended"
        if look.phase != "tools" or not look.call_state or look.call_state == "d":
            return "call done or not current"
        if self.gen < look.call_gen:
            return "superseded message"
        payload = look.payload
        if payload is None or payload.get("tool") != self.tool or not payload.get("agent"):
            return "the message does not name this run's call of a child agent"
        if look.status == "paused":
            return "paused (resume sends it again)"
        return ""

    def _child_there(self, look: children.Look, spec: RunSpec) -> None:
        assert look.payload is not None
        child = look.child
        if child.get("parent_key") != self.key or child.get("ancestors", "").split(" ")[0] != self.parent:
            self._fail(spec, look.payload, f"ChildRunTaken: run id {self.child} belongs to another run")
        elif child["status"] in ("completed", "failed", "aborted"):
            self._record(spec, look.payload, *child_output(self.child, child), duration_ms=_duration(child))
        else:
            verdict = children.park(self.store, self.parent, look.payload, self.gen, self.child, spec.tenant)
            if verdict == "child_ended":  # it ended meanwhile
                self.run()

    def _start(self, look: children.Look, spec: RunSpec) -> None:
        payload = look.payload
        assert payload is not None
        try:
            view = calls.view(spec, payload)
            child_spec, entry = children.build_child(spec, payload["agent"], view["arguments"],
                                                     look.tokens_used, look.cost_usd)  # fmt: skip
        except SecretError as exc:
            self._fail(spec, payload, f"SecretError: the call's arguments do not open here: {exc}")
            return
        except children.ChildRefused as exc:
            self._fail(spec, payload, str(exc))
            return
        from orchestrator.prompt import initial_messages

        given = protect.given_prompt(child_spec.prompt, spec.tenant)  # a secret in it: masked, kept sealed
        child_spec = child_spec.model_copy(update={"prompt": given["content"]})
        messages = [*initial_messages(child_spec, entry.steering_docs, entry.skill_docs)[:-1], given]
        verdict = children.start(self.store, self.parent, payload, self.gen, self.child, child_spec, messages,
                                 look.ancestors, spec)  # fmt: skip
        log.info("child call %s/%s: %s (child run %s)", self.parent, self.key, verdict, self.child)
        if verdict == "created":
            enqueue_turn(self.child, 1, 1, self.celery)
        elif verdict == "child_ended":
            self.run()
        elif verdict == "taken":
            self._fail(spec, payload, f"ChildRunTaken: run id {self.child} belongs to another run")

    def _fail(self, spec: RunSpec, payload: dict[str, Any], error: str) -> None:
        """A call that starts no child (or whose child is not its own): a failed record."""
        self._record(spec, payload, False, None, error)

    def _record(self, spec: RunSpec, payload: dict[str, Any], ok: bool, output: Any, error: str | None,
                duration_ms: float = 0.0) -> None:  # fmt: skip
        """Record the call for nobody (it holds no lease), fenced by this message's generation."""
        view = calls.view(spec, {**payload, "arguments": ""})  # the record shows the prompt, not sealed text
        inputs = _inputs(payload, spec)
        record, message = protect.tool_result(view, ok, output, error, inputs, duration_ms)
        iteration, index = int(payload["iteration"]), int(payload["index"])
        verdict, gen = self.store.record_call(self.parent, iteration, index, "", record, message, self.gen)
        log.info("child call %s/%s recorded: %s", self.parent, self.key, verdict)
        if verdict == "next":
            enqueue_turn(self.parent, iteration + 1, gen, self.celery)


def child_output(child_id: str, child: dict[str, str]) -> tuple[bool, Any, str | None]:
    """(success, output, error) of the call a child answers, from its final state."""
    exit_ = child.get("exit") or ""
    if exit_ in RESERVED_EXITS and exit_ != Exit.default:
        why = child.get("error") or exit_
        return False, None, f"ChildRun: child run {child_id} ended on {exit_}: {why}"
    if exit_ == Exit.default:
        return True, child.get("content") or "", None
    result = child.get("result")
    return True, json.loads(result) if result else None, None


def _duration(child: dict[str, str]) -> float:
    try:
        return float(int(child["ended_at"]) - int(child["created_at"]))
    except (KeyError, ValueError):
        return 0.0


def _inputs(payload: dict[str, Any], spec: RunSpec) -> Any:
    try:
        return json.loads(protect.open_arguments(payload.get("arguments") or "{}", spec.tenant))
    except (SecretError, ValueError):
        return None
