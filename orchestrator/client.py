"""The producer API: submit runs, follow them, control them, from any process."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orchestrator.control as control
import orchestrator.fairshare as fairshare
from orchestrator.events import Event
from orchestrator.keys import run_id_error
from orchestrator.models import RunResult, RunSpec, Status
from orchestrator.prompt import initial_messages
from orchestrator.settings import Settings, get_settings
from orchestrator.store import Recovery, RunStore
from orchestrator.telemetry import submit_span
from orchestrator.validation import SpecError, bind_tenant, check_spec, parse_spec_data


class Client:
    """``Client()`` reads its settings from the environment (``TOOLOOP_*``)."""

    def __init__(self, settings: Settings | None = None, store: RunStore | None = None) -> None:
        self.settings = settings or (store.settings if store else get_settings())
        self.store = store or RunStore.from_settings(self.settings)
        self._celery: Any = None

    @property
    def celery(self) -> Any:
        """The Celery app that sends this client's steps (created on first use)."""
        if self._celery is None:
            from orchestrator.dispatch import app_for  # (Celery: only a client that sends)

            self._celery = app_for(self.settings)
        return self._celery

    def submit(self, spec: RunSpec | dict[str, Any], run_id: str | None = None) -> RunHandle:
        """Validate, write and enqueue a run. A refused spec raises ``SpecError``,
        and nothing is written or enqueued."""
        from orchestrator.dispatch import enqueue_turn

        if run_id is not None and (bad := run_id_error(run_id)):
            raise SpecError([bad])
        spec = spec if isinstance(spec, RunSpec) else parse_spec_data(spec)
        spec = bind_tenant(spec, self.settings.tenant)
        report = check_spec(spec, self.store, run_id)
        if report.errors:
            raise SpecError(report.errors)
        run_id = run_id or uuid.uuid4().hex
        messages = initial_messages(spec, report.steering_docs, report.skill_docs)
        traced = {"tooloop.tenant": spec.tenant, "tooloop.model": spec.model}
        fair = fairshare.of(self.store)
        with submit_span(self.store.keys.prefix, run_id, traced):
            gen = self.store.create(run_id, report.stored_spec, messages, fair.mode if fair else "")
            if fair is not None and fair.policy.gating:  # sent now, or when its tenant's queue admits it
                fair.submitted(run_id, spec.tenant, self.celery)
            else:
                enqueue_turn(run_id, 1, gen, self.celery)
        return RunHandle(self, run_id, warnings=report.warnings)

    def get(self, run_id: str) -> RunHandle:
        if self.store.status(run_id) is None:
            raise KeyError(f"no run {run_id!r}")
        return RunHandle(self, run_id)

    def list(self, limit: int = 20, tenant: str | None = None) -> list[dict[str, str]]:
        return self.store.list_runs(limit, tenant)

    def resume(self, run_id: str, by: str = "operator") -> str:
        """Resume a paused run: enqueue the step it was parked on, unless its message
        still waits in the queue (at most one message per waiting step)."""
        from orchestrator.children import paused_children
        from orchestrator.dispatch import send
        from orchestrator.recovery import reenqueue

        kind, found = self.store.resume(run_id, by)
        if kind in ("turn", "calls", "none"):  # it takes its tenant's slot back (fair share)
            fairshare.moved(self.store, run_id, "resume", self.celery)
        for dispatch in found.sends:
            send(dispatch, self.celery)
        if found.checks:  # the sweeper's check: RESEND only what is gone from its queue
            reenqueue(self.store, Recovery(run_id, checks=found.checks), self.celery)
        if kind in ("turn", "calls", "none", "not_paused"):  # its paused child runs resume with it
            for child in paused_children(self.store, run_id):
                self.resume(child, f"{by} (parent {run_id})")
        return "ok" if kind in ("turn", "calls", "none") else kind

    def fork(self, run_id: str, at: int, prompt_append: str | None = None, model: str | None = None,
             by: str = "operator") -> RunHandle:  # fmt: skip
        """A new run whose history is ``run_id``'s as it stood when turn ``at`` began, its
        first turn ``at`` (orchestrator/fork.py). ``ForkError`` when refused (another
        tenant's run, for a producer bound to a tenant, is not found)."""
        from orchestrator.fork import fork_run

        tenant = self.settings.tenant or None
        return RunHandle(self, fork_run(self, run_id, at, prompt_append, model, tenant, by))

    def decide(self, run_id: str, call_id: str, approved: bool, reason: str = "",
               by: str = "operator") -> str:  # fmt: skip
        """Approve or deny a call waiting for a person: 'ok', or 'already' (decided before),
        'unknown' (no such call waiting), 'ended', 'missing'. An approved call is dispatched;
        a denied one is recorded failed with ``reason``, fed back to the model."""
        from orchestrator.approvals import decide
        from orchestrator.dispatch import enqueue_call

        verdict, payload, gen = decide(self.store, run_id, call_id, approved, reason, by)
        if payload is not None:
            enqueue_call(payload, gen, self.celery)
        return verdict


class RunHandle:
    """One run, by id: its state, its result, its events, its controls."""

    def __init__(self, client: Client, run_id: str, warnings: list[str] | None = None) -> None:
        self.client, self.run_id = client, run_id
        self.warnings = warnings or []  # from validation at submit (e.g. a missing steering file)

    def __repr__(self) -> str:
        return f"RunHandle({self.run_id!r})"

    @property
    def _store(self) -> RunStore:
        return self.client.store

    def status(self) -> Status | None:
        return self._store.status(self.run_id)

    def result(self) -> RunResult | None:
        return self._store.result(self.run_id)

    def wait(self, timeout: float | None = 300) -> RunResult:
        """Block until the run ends (no polling: follows its event stream)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self._store.follow_events(self.run_id, timeout=timeout):
            pass
        while True:  # the outcome event and the final state are written atomically
            result = self.result()
            if result is None:
                raise KeyError(f"no run {self.run_id!r}")
            if result.status.ended:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_id} still {result.status} after {timeout}s")
            for _ in self._store.follow_events(self.run_id, timeout=_left(deadline)):
                pass

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Progress events from the start, live, until the run's outcome: typed models,
        one class per ``type`` (``orchestrator.events``)."""
        yield from self._store.follow_events(self.run_id, timeout=timeout)

    def pause(self, by: str = "operator") -> str:
        return control.pause(self._store, self.run_id, by)

    def resume(self, by: str = "operator") -> str:
        return self.client.resume(self.run_id, by)

    def steer(self, text: str, by: str = "operator") -> str:
        return self._store.steer(self.run_id, text, by)

    def approve(self, call_id: str, by: str = "operator") -> str:
        """Let a call waiting for approval run (``call_id``: the model's tool call id)."""
        return self.client.decide(self.run_id, call_id, True, by=by)

    def deny(self, call_id: str, reason: str = "", by: str = "operator") -> str:
        """Refuse a call waiting for approval: the model gets a failed record with ``reason``."""
        return self.client.decide(self.run_id, call_id, False, reason, by)

    def pending_approvals(self) -> list[dict[str, Any]]:
        """Calls of this run waiting for a decision."""
        from orchestrator.approvals import pending

        return pending(self._store, self.run_id)

    def abort(self, reason: str = "abort requested", by: str = "operator") -> str:
        return control.abort(self._store, self.run_id, by, reason)

    def fork(self, at: int, prompt_append: str | None = None, model: str | None = None,
             by: str = "operator") -> RunHandle:  # fmt: skip
        """A new run with this run's history as it stood when turn ``at`` began: nothing
        before ``at`` runs again; ``prompt_append`` ends its history with that instruction,
        ``model`` runs it on another model. The parent is untouched."""
        return self.client.fork(self.run_id, at, prompt_append, model, by)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def load_spec(path: str | Path, prompt: str | None = None) -> RunSpec:
    """A spec from a YAML or JSON file; ``prompt`` replaces the file's prompt."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError([f"{path}: {exc}"]) from exc
    if not isinstance(data, dict):
        raise SpecError([f"{path}: a spec is a mapping of fields"])
    if prompt is not None:
        data["prompt"] = prompt
    spec = parse_spec_data(data)
    spec._source = Path(path).resolve()  # child specs' paths are read relative to it
    return spec
