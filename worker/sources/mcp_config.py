"""``TOOLOOP_MCP_SERVERS``: a JSON or YAML file in the ``mcpServers`` format MCP clients share.

```yaml
mcpServers:
  files:                       # stdio: a program the worker starts, in the sandbox
    command: python
    args: [-m, my_mcp_server]
    env: {LOG_LEVEL: warning}  # literal values, set for the program
  search:                      # streamable HTTP: a server that already runs
    url: https://search.internal/mcp
    headers: {Authorization: SEARCH_TOKEN}   # header -> NAME of an environment variable
```

Each server's tools join the catalog as ``<server>__<tool>``. Pure parsing: no MCP import.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.sandbox.constants import MAX_RESULT_BYTES

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SEPARATOR = "__"
# The host's reply to a pool process: a call's output at most at a forked call's cap, and
# its envelope. Bigger, the call fails as a forked one does.
MAX_REPLY_BYTES = MAX_RESULT_BYTES + (64 << 10)
TOO_LARGE = f"OutputTooLarge: the tool's output exceeds {MAX_RESULT_BYTES >> 20} MiB"


class McpConfigError(ValueError):
    """The ``mcpServers`` file cannot be used; the message says where."""


@dataclass(frozen=True)
class McpServer:
    name: str
    command: str | None = None  # stdio
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # streamable HTTP
    headers: dict[str, str] = field(default_factory=dict)  # header -> environment variable name

    @property
    def stdio(self) -> bool:
        return self.command is not None


def tool_name(server: str, tool: str) -> str | None:
    """The catalog name of a server's tool, or None when it cannot be an OpenAI function name."""
    name = f"{server}{SEPARATOR}{tool}"
    return name if NAME.fullmatch(name) else None


def load_servers(path: str) -> list[McpServer]:
    """The servers of the file ``TOOLOOP_MCP_SERVERS`` names; ``McpConfigError`` (one line
    naming the file and what is wrong) when it cannot be used."""
    where = f"TOOLOOP_MCP_SERVERS={path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise McpConfigError(f"{where}: {exc}") from exc
    return parse_servers(_parse(text, where), where)


def _parse(text: str, where: str) -> Any:
    if where.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise McpConfigError(f"{where}: not valid JSON: {exc}") from exc
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:  # one line: YAML's own message spans several
        raise McpConfigError(f"{where}: not valid YAML or JSON: {' '.join(str(exc).split())}") from exc


def parse_servers(data: Any, where: str = "mcpServers") -> list[McpServer]:
    if not isinstance(data, dict):
        what = "the file is empty" if data is None else f"not a {type(data).__name__}"
        raise McpConfigError(f"{where}: expected a mapping with an `mcpServers` key ({what})")
    if "mcpServers" not in data:  # other keys are other clients' settings (one file, several clients)
        raise McpConfigError(f"{where}: no `mcpServers` key{_found(data)}")
    servers = data["mcpServers"]
    if not isinstance(servers, dict):
        raise McpConfigError(f"{where}: `mcpServers` must be a mapping of server names")
    return [_server(name, entry, where) for name, entry in servers.items()]


def _found(data: dict[Any, Any]) -> str:
    import difflib

    keys = [str(k) for k in data]
    close = difflib.get_close_matches("mcpServers", keys, n=1, cutoff=0.6)
    if close:
        return f" (found `{close[0]}`: did you mean `mcpServers`?)"
    return f" (found {', '.join(f'`{k}`' for k in keys)})" if keys else " (the mapping is empty)"


def _server(name: str, entry: Any, where: str) -> McpServer:
    at = f"{where}: mcpServers.{name}"
    if not NAME.fullmatch(str(name)) or SEPARATOR in str(name):
        raise McpConfigError(f"{at}: server names use letters, digits, '_' and '-' (no '__')")
    if not isinstance(entry, dict):
        raise McpConfigError(f"{at}: expected a mapping")
    unknown = set(entry) - {"command", "args", "env", "url", "headers", "type", "transport"}
    if unknown:
        raise McpConfigError(f"{at}: unknown field(s) {sorted(unknown)}")
    if ("command" in entry) == ("url" in entry):
        raise McpConfigError(f"{at}: give either `command` (stdio) or `url` (streamable HTTP)")
    if "command" in entry:
        return McpServer(name, command=str(entry["command"]),
                         args=tuple(str(a) for a in _list(entry.get("args"), f"{at}.args")),
                         env=_strings(entry.get("env"), f"{at}.env"))  # fmt: skip
    url = str(entry["url"])
    if not url.startswith(("http://", "https://")):
        raise McpConfigError(f"{at}.url: must be an http:// or https:// URL")
    headers = _strings(entry.get("headers"), f"{at}.headers")
    bad = [h for h, env in headers.items() if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env)]
    if bad:
        raise McpConfigError(f"{at}.headers: values name environment variables; {bad} do not")
    return McpServer(name, url=url, headers=headers)


def _list(value: Any, at: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise McpConfigError(f"{at}: expected a list")
    return value


def _strings(value: Any, at: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise McpConfigError(f"{at}: expected a mapping")
    return {str(k): str(v) for k, v in value.items()}
