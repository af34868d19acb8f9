"""``@tool``: register a typed function as a tool the model may call.

``Tool`` is the callable with its options; ``ToolDef`` is the plain data sent
to the model and published to the catalog in Redis.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, overload

from pydantic import BaseModel

from worker.schema import arguments_model

SandboxLevel = Literal["default", "strict"]
ToolSource = Literal["python", "builtin", "mcp", "http"]


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolDef:
        return cls(data["name"], data["description"], data["parameters"])


@dataclass(frozen=True)
class Tool:
    fn: Callable[..., Any]
    definition: ToolDef
    arguments: type[BaseModel]
    injected: frozenset[str]
    timeout_s: float | None = None  # tighter than the spec's tool_timeout_s, if set
    idempotent: bool = False  # may run again after a worker is lost mid-call
    sandbox: SandboxLevel = "default"  # "strict": the strongest layer, as for shell
    builtin: bool = False
    source: ToolSource = "python"
    remote: dict[str, Any] | None = None  # mcp: {"server", "tool"}: where the call goes
    approval: bool = False  # each call waits for a person's decision (orchestrator/approvals.py)

    @property
    def name(self) -> str:
        return self.definition.name


REGISTRY: dict[str, Tool] = {}


def _register(
    fn: Callable[..., Any],
    name: str | None,
    timeout_s: float | None,
    idempotent: bool,
    sandbox: SandboxLevel,
    builtin: bool = False,
    approval: bool = False,
) -> Callable[..., Any]:
    tool_name = name or fn.__name__
    model, injected, description = arguments_model(fn, tool_name)
    schema = model.model_json_schema()
    schema.pop("title", None)
    definition = ToolDef(tool_name, description, schema)
    REGISTRY[tool_name] = Tool(
        fn, definition, model, frozenset(injected), timeout_s, idempotent, sandbox, builtin,
        source="builtin" if builtin else "python", approval=approval,
    )  # fmt: skip
    return fn


class _AnyArguments(BaseModel):
    """Remote tools check their own arguments (against the schema they published)."""

    model_config = {"extra": "allow"}


def _remote_only(**_: Any) -> Any:
    raise RuntimeError("a remote tool runs where its source is, not as a function")


def register_remote(definition: ToolDef, source: ToolSource, remote: dict[str, Any]) -> Tool:
    """A tool whose calls go elsewhere (an MCP server): catalog entry and dispatch data."""
    entry = Tool(_remote_only, definition, _AnyArguments, frozenset(), source=source, remote=remote)
    REGISTRY[definition.name] = entry
    return entry


@overload
def tool(fn: Callable[..., Any], /) -> Callable[..., Any]: ...
@overload
def tool(
    *,
    name: str | None = None,
    timeout_s: float | None = None,
    idempotent: bool = False,
    sandbox: SandboxLevel = "default",
    approval: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    timeout_s: float | None = None,
    idempotent: bool = False,
    sandbox: SandboxLevel = "default",
    approval: bool = False,
) -> Any:
    """Register ``fn`` as a tool; its schema comes from the signature and docstring.
    ``approval=True``: each call waits for a person's decision before it runs."""
    if fn is not None:
        return _register(fn, name, timeout_s, idempotent, sandbox, approval=approval)
    return lambda f: _register(f, name, timeout_s, idempotent, sandbox, approval=approval)


def builtin_tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Built-ins always get the strongest sandbox layer."""
    return _register(fn, None, None, False, "strict", builtin=True)


def load_tools(modules: list[str]) -> None:
    """Import the modules that register tools (built-ins first)."""
    importlib.import_module("worker.builtins")
    for module in modules:
        importlib.import_module(module)


def catalog() -> list[dict[str, Any]]:
    """What a worker publishes: each tool's definition and where it comes from."""
    return [{**asdict(t.definition), "source": t.source, **({"approval": True} if t.approval else {}),
             **({"idempotent": True} if t.idempotent else {})}  # a fork says which calls were not
            for t in REGISTRY.values()]  # fmt: skip


def function_schema(entry: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI tool schema of a catalog entry (its other keys are for tooloop only)."""
    return ToolDef.from_dict(entry).to_openai()
