"""A tool's JSON schema from its signature and docstring, with public pydantic."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

# Parameters filled from the run's context, never shown to the model.
INJECTED = frozenset({"sandbox_root", "resource_bindings"})

_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


class ToolDefinitionError(TypeError):
    """A function cannot be a tool; the message lists every problem found."""


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Description (text before the first section) and Google-style argument docs."""
    description: list[str] = []
    params: dict[str, str] = {}
    section, current = None, None
    for line in inspect.cleandoc(doc or "").splitlines():
        if _SECTION.match(line):
            section = "args" if _ARGS_HEADER.match(line) else "other"
            continue
        if section is None:
            description.append(line)
        elif section == "args":
            match = _ARG_LINE.match(line)
            indent = len(line) - len(line.lstrip())
            if match and indent <= 4:
                current = match.group(1)
                params[current] = match.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}"
    return "\n".join(description).strip(), params


def arguments_model(fn: Callable[..., Any], name: str) -> tuple[type[BaseModel], set[str], str]:
    """(pydantic model of the model-visible arguments, injected names, description)."""
    description, docs = parse_docstring(fn.__doc__)
    problems: list[str] = []
    fields: dict[str, Any] = {}
    injected: set[str] = set()
    for param in inspect.signature(fn).parameters.values():
        if param.name in INJECTED:
            injected.add(param.name)
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            problems.append(f"*{param.name}: variadic parameters cannot be described to a model")
            continue
        if param.annotation is inspect.Parameter.empty:
            problems.append(f"{param.name}: needs a type annotation")
            continue
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (param.annotation, Field(default, description=docs.get(param.name)))
    if not description:
        problems.append("needs a docstring: the model reads it to decide when to call the tool")
    if problems:
        raise ToolDefinitionError(f"tool {name!r}: " + "; ".join(problems))
    config = ConfigDict(extra="forbid")
    model = create_model(f"{name}_arguments", __config__=config, **fields)
    return model, injected, description
