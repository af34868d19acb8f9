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
    if store is not None:
        _check_tools(spec, store, report)
    return report


def _check_secrets(spec: RunSpec, report: SpecReport) -> None:
    try:
        sealed = seal_params(spec.model_params)
    except SecretError as exc:
        report.errors.append(str(exc))
        return
    if sealed is not spec.model_params:
        report.stored_spec = spec.model_copy(update={"model_params": sealed})


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
