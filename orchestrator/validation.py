"""Checks a spec must pass before anything is written: fields, tools, secrets, files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from orchestrator.models import RunSpec
from orchestrator.secrets import SecretError, seal_params
from orchestrator.settings import get_settings

if TYPE_CHECKING:
    from orchestrator.store import RunStore


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


def validation_messages(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        out.append(f"{where}: {msg}")
    return out


@dataclass
class SpecReport:
    stored_spec: RunSpec  # what goes to Redis: literal API keys sealed
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    steering_docs: list[str] = field(default_factory=list)
    skill_docs: list[str] = field(default_factory=list)


def check_spec(spec: RunSpec, store: RunStore | None) -> SpecReport:
    report = SpecReport(stored_spec=spec)
    _check_secrets(spec, report)
    _load_agent_docs(spec, store, report)
    _check_supervisor(spec, report)
    if store is not None:
        _check_tools(spec, store, report)
    _check_round_trip(report)
    return report


def _check_secrets(spec: RunSpec, report: SpecReport) -> None:
    """Seal literal API keys (the run's and the judge's) before they reach Redis."""
    try:
        sealed = seal_params(spec.model_params)
        judge = spec.supervisor.judge if spec.supervisor else None
        judge_sealed = seal_params(judge.model_params) if judge else None
    except SecretError as exc:
        report.errors.append(str(exc))
        return
    stored = spec.model_copy(update={"model_params": sealed})
    if judge is not None and judge_sealed is not judge.model_params:
        new_judge = judge.model_copy(update={"model_params": judge_sealed})
        stored.supervisor = spec.supervisor.model_copy(update={"judge": new_judge})
    report.stored_spec = stored


def _check_supervisor(spec: RunSpec, report: SpecReport) -> None:
    rules = spec.supervisor.rules if spec.supervisor else []
    if spec.token_budget is None and any(r.when == "budget_fraction" for r in rules):
        report.warnings.append("supervisor.rules: budget_fraction never fires without token_budget")


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


def _check_tools(spec: RunSpec, store: RunStore, report: SpecReport) -> None:
    catalog = store.catalog()
    if not catalog or not spec.tools:
        return  # no live tool worker has published yet: nothing to check against
    unknown = [name for name in spec.tools if name not in catalog]
    if unknown:
        known = ", ".join(sorted(catalog))
        report.errors.append(f"tools: {unknown} not provided by any live worker (known: {known})")
