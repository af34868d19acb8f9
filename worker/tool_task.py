"""The tool task: fence the call, validate, run it in the sandbox, record, maybe go on.

Never imports litellm: tool workers stay small and start fast.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import signals
from celery.utils.log import get_task_logger
from pydantic import ValidationError

from orchestrator import fairshare
from orchestrator.models import SandboxPolicy
from orchestrator.secrets import SecretError
from orchestrator.settings import get_settings
from orchestrator.store import CallStart, Dispatch, Finish, Held, RunStore, new_owner
from worker import calls, children, protect
from worker.app import TOOL_TASK, app, enqueue_turn, get_store
from worker.maintenance import INFLIGHT, with_retries
from worker.registry import REGISTRY, Tool
from worker.sandbox import CallOutcome, SandboxContext, run_call, settle

log = get_task_logger(__name__)

LOST = "WorkerLost: the worker running this call was lost; its outcome is unknown"


@signals.celeryd_after_setup.connect
def _start_fork_server(instance: Any, **_: Any) -> None:
    """A tools pool's main process starts the pool's sandbox fork server before it forks
    its processes (after worker.maintenance added the MCP tools to the registry)."""
    from worker.sandbox import zygote

    queues = list(instance.app.amqp.queues.consume_from or instance.app.amqp.queues)
    if get_store().keys.tool_queue in queues:
        zygote.start_hub()


@signals.worker_process_init.connect
def _connect_fork_server(**_: Any) -> None:
    """Each tool pool process connects to it as it starts, not at its first call."""
    from worker.sandbox import zygote

    zygote.start_early()


@app.task(name=TOOL_TASK)
def run_tool(message: dict[str, Any], gen: int = 0) -> None:
    """``message`` only names the call (worker/calls.py): what it may do is read from Redis."""
    if children.is_child_call(message) and children.ChildCall(get_store(), message, gen).run():
        return  # a call of a child agent starts a run, not a process (worker/children.py)
    ToolCall(get_store(), message, gen, worker=run_tool.request.hostname or "").run()


class ToolCall:
    def __init__(self, store: RunStore, message: dict[str, Any], gen: int = 0, worker: str = "") -> None:
        self.store, self.gen = store, gen
        self.worker = worker  # the Celery node that runs the call (its record says so: the console)
        self.p: dict[str, Any] = calls.message(message)  # the view, once START_CALL answered
        self.tool: Tool | None = None
        self.http: dict[str, Any] | None = None  # a declared HTTP tool
        self.held = Held(message["run_id"], "call", message["key"], new_owner(), message["iteration"])
        self.taken_over = False  # a heartbeat found the call taken over: record nothing

    def run(self) -> None:
        start = self._start()
        if start.verdict == "gate":
            if not self._bind(start, owner=""):  # not started: recorded for nobody
                return
            if not self._approved():
                return
            start = self._start(approved=True)
        if start.verdict == "elsewhere":
            # Routed to its tool's queue, so a worker without the tool never gets here; a
            # message from before routing (or a registry gone odd) is left for the sweeper.
            log.warning("call %s/%s: tool %r not on this worker; left for a worker that has it",
                        self.p["run_id"], self.p["key"], self.p["tool"])  # fmt: skip
            return
        if start.verdict == "mismatch":  # a message naming another tool than the stored call's
            log.warning("call %s/%s: the message names tool %r, not the stored call's; dropped",
                        self.p["run_id"], self.p["key"], self.p.get("tool"))  # fmt: skip
            return
        if start.verdict not in ("ok", "lost"):  # done, busy, paused, ended, stale, gave_up
            log.debug("call %s/%s skipped: %s", self.p["run_id"], self.p["key"], start.verdict)
            return
        try:
            if not self._bind(start, owner=self.held.owner):
                return
            # The process's heartbeat thread keeps the lease while the result is read, scrubbed
            # and recorded too (the call's own wait loop beats only while the tool runs).
            with INFLIGHT.hold(self.store, self.held):
                if start.verdict == "lost":
                    outcome, inputs = CallOutcome(False, error=LOST), self._raw_inputs()
                else:
                    outcome, inputs = self.execute()
                self.record(outcome, inputs)
        except Exception as exc:  # our own code failed (not the tool's): one failed attempt, not a
            # lapsed lease (a lost holder: three times the attempts, each after a lease)
            log.exception("call %s/%s failed", self.p["run_id"], self.p["key"])
            error = f"{type(exc).__name__}: {exc}"
            verdict = self.store.fail_call(self.p["run_id"], self.p["key"], self.held.owner, error)
            log.warning("call %s/%s: attempt failed (%s)", self.p["run_id"], self.p["key"], verdict)
        finally:
            settle()  # reap the call's process, fork the next one: after the hot path

    def _start(self, approved: bool = False) -> CallStart:
        """Claim the call and read its spec and stored call, in one round trip. A spec that
        no longer parses ends the run, as a turn does (raised, the call's lease lapsed and it
        was sent again up to the lost holders' cap, 9 times, ~12 s each)."""
        here = REGISTRY.get(self.p.get("tool") or "")
        try:
            return self.store.start_call(
                self.held.run_id, self.held.iteration, int(self.p["index"]), self.gen, self.held.owner,
                self.p.get("tool") or "", here is not None, bool(here and here.approval),
                here.idempotent if here else True, approved,
            )  # fmt: skip
        except ValidationError as exc:
            log.error("call %s/%s: the run's stored spec does not parse; the run ends", self.held.run_id,
                      self.held.key)  # fmt: skip
            self.store.finish(self.held.run_id, Finish.unreadable(exc))
            return CallStart("ended")

    def _bind(self, start: CallStart, owner: str) -> bool:
        """Everything the call may do, from the stored spec and the stored call. False when
        its sealed arguments do not open here (this worker has no TOOLOOP_SECRET_KEY, or
        another one): the call is recorded failed at once, as ``owner``. Sending it again
        would fail the same way on this worker, and end as a "lost" call."""
        assert start.spec is not None and start.call is not None
        try:
            self.p = calls.view(start.spec, start.call)
        except SecretError as exc:
            self.p = calls.view(start.spec, {**start.call, "arguments": ""})  # never opened
            log.error("call %s/%s: its sealed arguments do not open on this worker: %s", self.p["run_id"],
                      self.p["key"], exc)  # fmt: skip
            self.record(CallOutcome(False, error=f"SecretError: {sealed_error(exc)}"), None, owner=owner)
            return False
        self.http = self.p["http_tool"]
        self.tool = REGISTRY.get(self.p["tool"]) if self.p["allowed"] else None
        return True

    def _approved(self) -> bool:
        """A gated call runs once a person approved it; until then it is parked, and no
        slot or lease is held (orchestrator/approvals.py). A denial is its record."""
        from orchestrator.approvals import park

        gate = park(self.store, self.p, self._raw_inputs())
        if gate.verdict == "denied":
            # never started, so recorded for nobody, fenced by this message's generation
            self.record(CallOutcome(False, error=f"Denied: {gate.reason}"), self._raw_inputs(), owner="")
        elif gate.verdict != "approved":
            log.debug("call %s/%s: approval %s", self.p["run_id"], self.p["key"], gate.verdict)
        return gate.verdict == "approved"

    def execute(self) -> tuple[CallOutcome, Any]:
        if self.http is not None:
            return self._http(), self._raw_inputs()
        if self.tool is None:
            return CallOutcome(False, error=self._unknown()), self._raw_inputs()
        try:
            raw = json.loads(self.p["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            error = f"InvalidArguments: arguments are not valid JSON ({exc})"
            return CallOutcome(False, error=error), self.p["arguments"]
        if self.tool.remote is not None:
            return self._remote(raw), raw
        try:
            args = self.tool.arguments.model_validate(raw)
        except ValidationError as exc:
            error = f"ValidationError: {_brief(exc)}"
            return CallOutcome(False, error=error), raw
        inputs = args.model_dump(mode="json")
        kwargs = {**dict(args), **self._injected()}
        return run_call(self.tool.fn, kwargs, self._sandbox()), inputs

    def record(self, outcome: CallOutcome, inputs: Any, owner: str | None = None) -> None:
        """Record as the call's owner (retrying a Redis blip within the lease); a holder
        that was taken over records nothing: its late result is dropped. ``owner`` '':
        a call never started (a denial), recorded if this message's generation is current."""
        if self.taken_over:
            log.warning("call %s/%s was taken over; its result is dropped", self.p["run_id"],
                        self.p["key"])  # fmt: skip
            return
        # scrubbed and bounded: the record (16 KiB) and what the model sees (max_tool_output_chars)
        record, message = protect.tool_result(self.p, outcome.ok, outcome.output, outcome.error, inputs,
                                              outcome.duration_ms)  # fmt: skip
        verdict, gen = with_retries(
            self.store.record_call, self.p["run_id"], self.p["iteration"], self.p["index"],
            self.held.owner if owner is None else owner, record, message, self.gen, self.worker,
            budget_s=self.store.settings.lease_s,
        )  # fmt: skip
        if verdict == "next":
            enqueue_turn(self.p["run_id"], self.p["iteration"] + 1, gen)
            fairshare.ahead(self.store, self.p.get("tenant") or "default", Dispatch(self.p["run_id"], gen,
                            self.p["iteration"] + 1))  # fmt: skip
        elif verdict == "stale":
            log.warning("call %s/%s was taken over; its result is dropped", self.p["run_id"],
                        self.p["key"])  # fmt: skip

    def _remote(self, raw: Any) -> CallOutcome:
        """An MCP server's tool: the worker's MCP host runs the call (worker/sources)."""
        assert self.tool is not None and self.tool.remote is not None
        if not isinstance(raw, dict):
            return CallOutcome(False, error="ValidationError: arguments: must be a JSON object")
        from worker.sources import mcp_tools

        settings = self.store.settings
        request = {"run_id": self.p["run_id"], "workdir": self._run_dir(), "timeout_s": self._timeout(),
                   "sandbox_root": settings.sandbox_root, "mode": settings.sandbox,
                   "policy": self.p.get("policy") or {}}  # fmt: skip
        return mcp_tools.call(self.tool.remote, raw, request, self._still_ours)

    def _http(self) -> CallOutcome:
        """A declared HTTP tool: the request is sent from this process (worker/sources)."""
        from worker.sources import http_tools

        assert self.http is not None
        try:
            raw = json.loads(self.p["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            return CallOutcome(False, error=f"InvalidArguments: arguments are not valid JSON ({exc})")
        return http_tools.call(self.http, raw, self.p["timeout_s"], self.store.settings, self._still_ours)

    # -- helpers ------------------------------------------------------------
    def _timeout(self) -> float:
        assert self.tool is not None
        timeout = self.p["timeout_s"]
        if self.tool.timeout_s is not None:
            timeout = min(timeout, self.tool.timeout_s)
        return timeout

    def _sandbox(self) -> SandboxContext:
        assert self.tool is not None
        settings = self.store.settings
        return SandboxContext(
            workdir=self._run_dir(),  # checked, then prepared, by run_call
            run_id=self.p["run_id"],
            timeout_s=self._timeout(),
            policy=SandboxPolicy.model_validate(self.p.get("policy") or {}),
            on_tick=self._still_ours,
            strict=self.tool.sandbox == "strict",
            mode=settings.sandbox,
            sandbox_root=settings.sandbox_root,
            defer_cleanup=True,  # settle() after the record
        )

    def _still_ours(self) -> bool:
        """Heartbeat the call's lease; False once the run ended (the call is killed and
        recorded as aborted) or the call was taken over (killed, and nothing recorded)."""
        [beat] = self.store.heartbeat([self.held])
        self.taken_over = beat == 0
        return beat == 1

    def _run_dir(self) -> str:
        given = self.p.get("sandbox_root")
        return given or os.path.join(self.store.settings.sandbox_root, self.p["run_id"])

    def _injected(self) -> dict[str, Any]:
        assert self.tool is not None
        values = {"sandbox_root": self._run_dir(), "resource_bindings": self.p.get("bindings") or {}}
        return {name: values[name] for name in self.tool.injected}

    def _raw_inputs(self) -> Any:
        try:
            return json.loads(self.p["arguments"] or "{}")
        except json.JSONDecodeError:
            return self.p["arguments"]

    def _unknown(self) -> str:
        name = self.p["tool"]
        allowed = ", ".join(self.p.get("allowed_tools") or []) or "none"
        return f"UnknownTool: no tool named {name!r} is available (tools: {allowed})"


def sealed_error(exc: SecretError) -> str:
    """What the model and the record say about arguments that do not open here."""
    why = ("this tool worker has no TOOLOOP_SECRET_KEY" if not get_settings().secret_key
           else f"they do not open with this tool worker's TOOLOOP_SECRET_KEY ({exc})")  # fmt: skip
    return f"the call's arguments hold a secret and travel sealed; {why}: the call was not run"


def _brief(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()
    )
