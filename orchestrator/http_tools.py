"""Declared HTTP tools: a spec's ``http_tools``, or an agent folder's ``tools/*.yaml``.

```yaml
http_tools:
  - name: get_issue
    description: Read one issue of the tracker.
    parameters:
      type: object
      properties: {number: {type: integer}}
      required: [number]
    method: GET
    url: https://tracker.example.com/api/issues/{number}   # {arg}: URL-encoded argument (bare: no {arg:spec})
    headers: {Accept: application/json}                     # literal values
    env_headers: {Authorization: "Bearer ${TRACKER_TOKEN}"} # from the worker's environment
    body: null            # JSON body template: "{arg}" alone keeps the argument's JSON type
    allow_hosts: [tracker.example.com]                      # required
    timeout_s: 30
    max_response_bytes: 1000000
  - agents/reviewer/tools/search.yaml                       # the same, one tool per file
```

Declaring a tool lets the run's model call it (it need not be listed in ``tools``).
The rules that keep a submitter from sending the worker's secrets where they choose
(``env_headers``: only variables of ``TOOLOOP_ALLOWED_KEY_ENVS``, only to URLs under
``TOOLOOP_ALLOWED_API_BASES``) are checked here at submit and again by the worker
before every request (``worker/sources/http_tools.py``). Pure data: no HTTP client.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.credentials import api_bases, base_allowed, key_env_allowed, key_env_patterns
from orchestrator.scalars import Float, Int

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
PLACEHOLDER = re.compile(r"[^.\[\]{}!:]+")  # a property's name as str.format reads it: no '.', '[', '!', ':'
HOST = re.compile(r"[A-Za-z0-9.-]+(:\d{1,5})?|\[[0-9A-Fa-f:.]+\](:\d{1,5})?")
MAX_RESPONSE_BYTES = 10 << 20  # the most a spec may ask for


class HttpTool(BaseModel):
    """One HTTP call the model may make; see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"] = "GET"
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    env_headers: dict[str, str] = Field(default_factory=dict)
    body: Any = None
    allow_hosts: list[str] = Field(min_length=1)
    timeout_s: Float = Field(default=30, gt=0, le=3600)
    max_response_bytes: Int = Field(default=1_000_000, ge=1, le=MAX_RESPONSE_BYTES)

    @field_validator("name")
    @classmethod
    def _function_name(cls, value: str) -> str:
        if not TOOL_NAME.fullmatch(value):
            raise ValueError("tool names use letters, digits, '_' and '-' (at most 64)")
        return value

    @field_validator("method", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"https?://[^/{}?#]+", value):
            raise ValueError("must start with http:// or https:// and a fixed host (no {placeholder} there)")
        return value

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        bad = [h for h in hosts if not HOST.fullmatch(h)]
        if bad:
            raise ValueError(f"host names (optionally host:port), not URLs or patterns: {bad}")
        return [h.lower() for h in hosts]

    @field_validator("env_headers")
    @classmethod
    def _env_templates(cls, headers: dict[str, str]) -> dict[str, str]:
        for header, template in headers.items():
            if not ENV_REF.search(template):
                raise ValueError(f"{header}: name a variable as ${{NAME}}; literal values go in `headers`")
            if "{" in ENV_REF.sub("", template).replace("${", ""):
                raise ValueError(f"{header}: only ${{NAME}} references, no argument placeholders")
        return headers

    @model_validator(mode="after")
    def _placeholders(self) -> HttpTool:
        properties = set((self.parameters or {}).get("properties") or {})
        used = set(placeholders(self.url, "url"))
        for header, value in self.headers.items():
            used |= set(placeholders(value, f"headers.{header}"))
        used |= set(body_placeholders(self.body))
        unknown = sorted(used - properties)
        if unknown:
            raise ValueError(f"placeholders {unknown} are not among the parameters' properties")
        if self.parameters.get("type", "object") != "object":
            raise ValueError("parameters: the schema of the arguments must be of type object")
        return self

    @model_validator(mode="after")
    def _own_host_allowed(self) -> HttpTool:
        split = urlsplit(fixed_prefix(self.url))
        try:
            port = split.port or (443 if split.scheme == "https" else 80)
        except ValueError as exc:
            raise ValueError(f"url: {exc}") from None
        if not host_allowed((split.hostname or "").lower(), port, self.allow_hosts):
            raise ValueError(f"url: its host {split.netloc} is not in allow_hosts")
        return self

    @property
    def env_names(self) -> list[str]:
        return sorted({n for t in self.env_headers.values() for n in ENV_REF.findall(t)})

    def definition(self) -> dict[str, Any]:
        """What the model sees, and what the catalog would hold."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def host_allowed(host: str, port: int, allowed: list[str]) -> bool:
    """Exact host names (and ports, where an entry gives one): no patterns, no suffixes."""
    return any(name == host and wanted in (None, port) for name, wanted in map(split_host, allowed))


def split_host(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> (host, port or None)."""
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        return name, int(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:
        name, port = entry.split(":")
        return name, int(port)
    return entry, None


def template_parts(template: str, where: str = "template") -> list[tuple[str, str | None]]:
    """``template`` as (literal text, placeholder name or None) pairs; ``{{`` and ``}}`` are
    literal braces. Only bare ``{name}`` placeholders: a format spec (``{q:>400000000}``
    renders 400 MB), a conversion (``{q!r}``), an attribute or an index (``{q.x}``,
    ``{q[0]}``) or a positional ``{}`` raises ``ValueError`` naming ``where``."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:  # an unmatched brace
        raise ValueError(f"{where}: {exc} (only bare {{name}} placeholders; {{{{ }}}} are braces)") from None
    parts: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in parsed:
        if field is not None and (spec or conversion or not PLACEHOLDER.fullmatch(field)):
            shown = _clip("{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" * bool(spec)))
            raise ValueError(f"{where}: {shown}}}: only bare {{name}} placeholders (no format spec, "
                             "conversion, attribute or index)")  # fmt: skip
        parts.append((literal, field))
    return parts


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def placeholders(template: str, where: str = "template") -> list[str]:
    return [field for _, field in template_parts(template, where) if field]


def body_placeholders(body: Any, where: str = "body") -> list[str]:
    if isinstance(body, str):
        return placeholders(body, where)
    if isinstance(body, dict):
        return [p for k, v in body.items() for p in body_placeholders(v, f"{where}.{k}")]
    if isinstance(body, list):
        return [p for i, v in enumerate(body) for p in body_placeholders(v, f"{where}.{i}")]
    return []


def credential_problems(tool: HttpTool, allowed_key_envs: str, allowed_api_bases: str,
                        url: str | None = None) -> list[str]:  # fmt: skip
    """Why the worker's environment may not be sent as this tool asks; [] if it may.
    ``url``: the rendered URL (in the worker); at submit, the template's fixed part."""
    if not tool.env_headers:
        return []
    problems = []
    patterns = key_env_patterns(allowed_key_envs)
    refused = [n for n in tool.env_names if not key_env_allowed(n, patterns)]
    if refused:
        problems.append(f"env_headers name {refused}, not allowed by TOOLOOP_ALLOWED_KEY_ENVS")
    target = url if url is not None else fixed_prefix(tool.url)
    # the query is the arguments' place; scheme, host, port and path must lie under a base
    where = urlsplit(target)._replace(query="", fragment="").geturl()
    if not base_allowed(where, api_bases(allowed_api_bases)):
        problems.append(f"env_headers would send the worker's variables to {target}, which is not "
                        "under TOOLOOP_ALLOWED_API_BASES")  # fmt: skip
    return problems


def fixed_prefix(template: str) -> str:
    """The URL up to its first placeholder, query or fragment (what a submitter fixed)."""
    cut = min([i for i in (template.find("{"), template.find("?"), template.find("#")) if i >= 0],
              default=len(template))  # fmt: skip
    return template[:cut]


# -- submit ------------------------------------------------------------------------------
def check_http_tools(spec: Any, catalog: dict[str, Any] | None, settings: Any, report: Any) -> None:
    """Read tool files, check each declaration, store them inline (``report.stored_spec``)."""
    if not spec.http_tools:
        return
    from orchestrator.agents import agents_root

    tools, errors = load_http_tools(spec.http_tools, agents_root(settings.agents_dir))
    report.errors += errors
    for tool in tools:
        where = f"http_tools.{tool.name}"
        problems = credential_problems(tool, settings.allowed_key_envs, settings.allowed_api_bases)
        problems += _schema_problems(tool.parameters)
        if tool.name in spec.tools or (catalog and tool.name in catalog):
            problems.append("the name of a tool of the catalog: declared tools cannot replace it")
        report.errors += [f"{where}: {p}" for p in problems]
    report.stored_spec = report.stored_spec.model_copy(update={"http_tools": tools})


def _schema_problems(schema: dict[str, Any]) -> list[str]:
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return [f"parameters: not a JSON schema: {exc.message}"]
    return []


def declared(spec: Any) -> dict[str, HttpTool]:
    """The run's HTTP tools by name (the stored spec holds them inline)."""
    return {t.name: t for t in spec.http_tools if isinstance(t, HttpTool)}


# -- agent folders: tools/*.yaml ---------------------------------------------------------
TOOL_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def load_http_tools(entries: list[HttpTool | str], root: Path) -> tuple[list[HttpTool], list[str]]:
    """Inline declarations as they are; a path names a file in an agent's ``tools``
    folder (read now, at submit: workers never read it). (tools, errors)."""
    tools: list[HttpTool] = []
    errors: list[str] = []
    for index, entry in enumerate(entries):
        if isinstance(entry, HttpTool):
            tools.append(entry)
        else:
            tools += _from_file(f"http_tools.{index}", entry, root, errors)
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        errors.append(f"http_tools: {duplicates} declared more than once")
    return tools, errors


def _from_file(where: str, raw: str, root: Path, errors: list[str]) -> list[HttpTool]:
    import yaml
    from pydantic import ValidationError

    from orchestrator.agents import resolve

    path = resolve(raw, root)
    problem = _placement_problem(path, root)
    if problem:
        errors.append(f"{where}: {raw!r} {problem}")
        return []
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        errors.append(f"{where}: {raw!r} cannot be read: {exc}")
        return []
    found = []
    for item in data if isinstance(data, list) else [data]:
        try:
            found.append(HttpTool.model_validate(item))
        except ValidationError as exc:
            for err in exc.errors():
                at = ".".join(str(p) for p in err["loc"]) or "tool"
                errors.append(f"{where}: {raw!r}: {at}: {err['msg']}")
    return found


def _placement_problem(path: Path, root: Path) -> str | None:
    expected = f"{root}/<agent>/tools/"
    if not path.is_relative_to(root):
        return f"resolves to {path}, outside the agents folder: it must be in {expected}"
    parts = path.relative_to(root).parts
    if len(parts) < 3 or parts[1] != "tools":
        return f"is not in an agent's tools folder: it must be in {expected}"
    if path.suffix not in TOOL_FILE_SUFFIXES:
        return "is not a YAML or JSON file"
    if not path.is_file():
        return "not found"
    return None
