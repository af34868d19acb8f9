"""What checking a spec finds: its report, and pydantic's errors said in the spec's words.
Used by the checks at submit (orchestrator/validation.py) and by those of child specs
(orchestrator/children.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from orchestrator.models import RunSpec

STRICT_TYPES = ("int_type", "float_type", "bool_type")  # strict fields (orchestrator/scalars.py)


def validation_messages(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] in STRICT_TYPES:  # `true` or "5" where a number goes: say what was given
            msg += f", not {err['input']!r}"
        out.append(f"{where}: {msg}")
    return out


@dataclass
class SpecReport:
    stored_spec: RunSpec  # what goes to Redis: credentials sealed for the tenant
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    steering_docs: list[str] = field(default_factory=list)
    skill_docs: list[str] = field(default_factory=list)
