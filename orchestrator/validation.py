"""Checks a spec must pass before anything is written: fields, tools, secrets, files."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from orchestrator.bounds import spec_size_error
from orchestrator.credentials import check_call
from orchestrator.http_tools import check_http_tools
from orchestrator.models import RunSpec
from orchestrator.secrets import SecretError, seal_params
from orchestrator.settings import Settings, get_settings
from orchestrator.spec_report import SpecReport, validation_messages

if TYPE_CHECKING:
    from orchestrator.children import Lineage
    from orchestrator.store import RunStore


def bind_tenant(spec: RunSpec, tenant: str) -> RunSpec:
    """A producer configured with a tenant (``TOOLOOP_TENANT``) submits only for it: a spec
    that names no tenant gets it, one naming another is refused (``SpecError``)."""
    if not tenant:
        return spec
    if "tenant" not in spec.model_fields_set:
        return spec.model_copy(update={"tenant": tenant})
    if spec.tenant != tenant:
        why = f"{spec.tenant!r} is not this producer's tenant {tenant!r} (TOOLOOP_TENANT)"
        raise SpecError([f"tenant: {why}"])
    return spec


class SpecError(ValueError):
    """A spec was refused; ``errors`` names each field at fault."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("spec refused:\n" + "\n".join(f"  - {e}" for e in errors))


def parse_spec_data(data: dict[str, Any]) -> RunSpec:
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(validation_messages(exc)) from exc


def check_spec(spec: RunSpec, store: RunStore | None, run_id: str | None = None,
               lineage: Lineage | None = None) -> SpecReport:  # fmt: skip
    """Every check at submit. ``run_id``: the id the caller gives the run, if any (a
    ``context.sandbox_root`` of ``$TOOLOOP_SANDBOX_ROOT/<name>`` is that run's folder only).
    ``lineage``: where a child spec sits in its tree (orchestrator/children.py)."""
    settings = store.settings if store is not None else get_settings()
    report = SpecReport(stored_spec=spec)
    if too_large := spec_size_error(spec.model_dump_json(exclude_defaults=True)):
        report.errors.append(too_large)
        return report  # the other checks would only read it
    _check_secrets(spec, report, settings)
    _check_scrub_opt_out(spec, settings, report)
    _load_agent_docs(spec, store, report)
    _check_supervisor(spec, report)
    _check_sandbox_root(spec, settings, run_id, report)
    # read once (one round trip), and only when a tool is named or declared
    catalog = store.catalog() if store is not None and (spec.tools or spec.http_tools) else None
    if catalog is not None:
        _check_tools(spec, catalog, report)
    check_http_tools(spec, catalog, settings, report)
    check_approval(report)
    _check_agents(spec, store, settings, report, lineage)
    _check_round_trip(report)
    return report


def _check_agents(spec: RunSpec, store: RunStore | None, settings: Settings, report: SpecReport,
                  lineage: Lineage | None) -> None:  # fmt: skip
    """Child agents: each checked as if submitted, the tree stored inline (orchestrator/children.py)."""
    if not spec.agents:
        return
    from orchestrator.children import Lineage, check_agents

    check_agents(spec, store, report, lineage or Lineage.root(spec, settings.agents_dir), _check_child)
    if lineage is None and (too_large := spec_size_error(report.stored_spec.model_dump_json())):
        report.errors.append(f"agents: with its child specs inline, {too_large}")


def _check_secrets(spec: RunSpec, report: SpecReport, settings: Settings) -> None:
    """What the spec asks of the worker's credentials (orchestrator/credentials.py), then
    every credential sealed for the run's tenant before it reaches Redis: the run's
    params (shared by its fallbacks) and the judge's."""
    judge = spec.supervisor.judge if spec.supervisor else None
    report.errors += check_model_params(spec, settings)
    if report.errors:
        return
    try:
        sealed = seal_params(spec.model_params, spec.tenant)
        judge_sealed = seal_params(judge.model_params, spec.tenant, where=JUDGE_PARAMS) if judge else None
    except SecretError as exc:
        report.errors += str(exc).splitlines()
        return
    stored = spec.model_copy(update={"model_params": sealed})
    if judge is not None and spec.supervisor is not None:
        new_judge = judge.model_copy(update={"model_params": judge_sealed})
        stored.supervisor = spec.supervisor.model_copy(update={"judge": new_judge})
    report.stored_spec = stored


def _check_sandbox_root(spec: RunSpec, settings: Settings, run_id: str | None, report: SpecReport) -> None:
    """``context.sandbox_root`` is handed to the run's tools: only inside the operator's roots,
    and, under the sandbox root, only the run's own folder (what the worker checks again)."""
    if spec.context is None or spec.context.sandbox_root is None:
        return
    from orchestrator.sandbox_roots import FolderRefused, check_given

    try:
        check_given(settings, spec.context.sandbox_root, run_id)
    except FolderRefused as exc:
        report.errors.append(f"context.sandbox_root: {exc}")


JUDGE_PARAMS = "supervisor.judge.model_params"


def check_model_params(spec: RunSpec, settings: Settings | None = None) -> list[str]:
    """The credential rules for every model the run may call: its model, its fallbacks
    (which share model_params) and the judge."""
    settings = settings or get_settings()
    models = [("model", spec.model)]
    # `fallbacks` (issue 8) share the run's model_params: each model string is checked too.
    models += [(f"fallbacks.{i}", m) for i, m in enumerate(getattr(spec, "fallbacks", None) or [])]
    errors: list[str] = []
    for field_name, model in models:
        errors += check_call(model, spec.model_params, settings, "model_params", field_name)
    judge = spec.supervisor.judge if spec.supervisor else None
    if judge is not None:
        errors += check_call(judge.model, judge.model_params, settings, JUDGE_PARAMS,
                             "supervisor.judge.model")  # fmt: skip
    return list(dict.fromkeys(errors))  # fallbacks repeat the params' findings


def _check_scrub_opt_out(spec: RunSpec, settings: Settings, report: SpecReport) -> None:
    """Unscrubbed originals are kept sealed for the model: that needs the deployment's key."""
    if not spec.scrub_model_input and not settings.secret_key:
        report.errors.append("scrub_model_input: false keeps unmasked tool outputs sealed in Redis; "
                             "set TOOLOOP_SECRET_KEY (shared with the workers)")  # fmt: skip


def _check_supervisor(spec: RunSpec, report: SpecReport) -> None:
    rules = spec.supervisor.rules if spec.supervisor else []
    if spec.token_budget is None and any(r.when == "budget_fraction" for r in rules):
        report.warnings.append("supervisor.rules: budget_fraction never fires without token_budget")


def check_approval(report: SpecReport) -> None:
    """``approval`` names only tools the run may call."""
    spec = report.stored_spec
    callable_names = set(spec.tools) | {t.name for t in spec.http_tools if not isinstance(t, str)}
    unknown = [name for name in spec.approval if name not in callable_names]
    if unknown:
        report.errors.append(f"approval: {unknown} are not among the run's tools or http_tools")


def _check_round_trip(report: SpecReport) -> None:
    """Workers re-read the stored spec: it must parse again, or the run could not start."""
    try:
        RunSpec.model_validate_json(report.stored_spec.model_dump_json())
    except ValidationError as exc:
        report.errors += [f"stored spec does not parse again: {m}" for m in validation_messages(exc)]


def _load_agent_docs(spec: RunSpec, store: RunStore | None, report: SpecReport) -> None:
    """Read steering files and skills now, in the submitter's process: workers never do."""
    if not (spec.steering_files or spec.skills):
        return
    from orchestrator.agents import agents_root, load_docs

    settings = store.settings if store is not None else get_settings()
    docs = load_docs(spec.steering_files, spec.skills, agents_root(settings.agents_dir))
    report.steering_docs, report.skill_docs = docs.steering, docs.skills
    report.errors += docs.errors
    report.warnings += docs.warnings


def _check_tools(spec: RunSpec, catalog: dict[str, Any], report: SpecReport) -> None:
    if not catalog or not spec.tools:
        return  # no live tool worker has published yet: nothing to check against
    unknown = [name for name in spec.tools if name not in catalog]
    if unknown:
        known = ", ".join(sorted(catalog))
        report.errors.append(f"tools: {unknown} not provided by any live worker (known: {known})")


def _check_child(child: RunSpec, store: RunStore | None, lineage: Lineage) -> SpecReport:
    """A child spec, checked as if submitted where ``lineage`` places it (check_agents)."""
    return check_spec(child, store, lineage=lineage)
