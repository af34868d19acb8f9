"""The tool task: fence the call, validate, run it in the sandbox, record, maybe go on.

Never imports litellm: tool workers stay small and start fast.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery.utils.log import get_task_logger
from pydantic import ValidationError

from orchestrator.models import SandboxPolicy, ToolCallRecord
from orchestrator.store import RunStore
from worker.app import TOOL_TASK, app, enqueue_turn, get_store
from worker.registry import REGISTRY, Tool
from worker.sandbox import CallOutcome, SandboxContext, prepare_workdir, run_call, settle

log = get_task_logger(__name__)

LOST = "WorkerLost: the worker running this call was lost; its outcome is unknown"


@app.task(name=TOOL_TASK)
def run_tool(payload: dict[str, Any]) -> None:
    ToolCall(get_store(), payload).run()


class ToolCall:
    def __init__(self, store: RunStore, payload: dict[str, Any]) -> None:
        self.store = store
        self.p = payload
        self.tool: Tool | None = REGISTRY.get(payload["tool"]) if payload.get("allowed") else None

    def run(self) -> None:
        idempotent = self.tool.idempotent if self.tool else True
        verdict = self.store.start_call(self.p["run_id"], self.p["iteration"], self.p["index"],
                                        idempotent)  # fmt: skip
        if verdict == "lost":
            outcome, inputs = CallOutcome(False, error=LOST), self._raw_inputs()
        elif verdict == "ok":
            outcome, inputs = self.execute()
        else:  # done, busy, paused, ended, stale: somebody else owns this step
            log.debug("call %s/%s skipped: %s", self.p["run_id"], self.p["key"], verdict)
            return
        try:
            self.record(outcome, inputs)
        finally:
            settle()  # reap the call's process, fork the next one: after the hot path

    def execute(self) -> tuple[CallOutcome, Any]:
        if self.tool is None:
            return CallOutcome(False, error=self._unknown()), self._raw_inputs()
        try:
            raw = json.loads(self.p["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            error = f"InvalidArguments: arguments are not valid JSON ({exc})"
            return CallOutcome(False, error=error), self.p["arguments"]
        try:
            args = self.tool.arguments.model_validate(raw)
        except ValidationError as exc:
            error = f"ValidationError: {_brief(exc)}"
            return CallOutcome(False, error=error), raw
        inputs = args.model_dump(mode="json")
        kwargs = {**dict(args), **self._injected()}
        return run_call(self.tool.fn, kwargs, self._sandbox()), inputs

    def record(self, outcome: CallOutcome, inputs: Any) -> None:
        record = ToolCallRecord(
            call_id=self.p["call_id"], tool_name=self.p["tool"], inputs=inputs,
            output=outcome.output, duration_ms=outcome.duration_ms, success=outcome.ok,
            error=outcome.error, iteration=self.p["iteration"],
        )  # fmt: skip
        content = json.dumps(outcome.output) if outcome.ok else f"Error: {outcome.error}"
        message = {"role": "tool", "tool_call_id": self.p["call_id"], "content": content}
        verdict = self.store.record_call(self.p["run_id"], self.p["iteration"], self.p["index"],
                                         record, json.dumps(message))  # fmt: skip
        if verdict == "next":
            enqueue_turn(self.p["run_id"], self.p["iteration"] + 1)

    # -- helpers ------------------------------------------------------------
    def _sandbox(self) -> SandboxContext:
        assert self.tool is not None
        timeout = self.p["timeout_s"]
        if self.tool.timeout_s is not None:
            timeout = min(timeout, self.tool.timeout_s)
        settings = self.store.settings
        return SandboxContext(
            workdir=prepare_workdir(self._run_dir(), settings.sandbox_root),
            timeout_s=timeout,
            policy=SandboxPolicy.model_validate(self.p.get("policy") or {}),
            on_tick=self._still_ours,
            strict=self.tool.sandbox == "strict",
            mode=settings.sandbox,
            sandbox_root=settings.sandbox_root,
            defer_cleanup=True,  # settle() after the record
        )

    def _still_ours(self) -> bool:
        """Heartbeat the call's lease; False once the run ended or the call was taken over."""
        beat = self.store.heartbeat([(self.p["run_id"], "call", self.p["key"])])
        return bool(beat) and beat[0] == 1

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


def _brief(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()
    )
