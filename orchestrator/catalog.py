"""The live tool catalog, as ``tooloop tools`` shows it: each tool, where it comes from
(python, builtin, mcp, http) and which live workers offer it.

Workers publish their tools with their registry entry (``RunStore.publish_worker``);
HTTP tools are declared per run in specs, so they appear here only as a source kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.store import RunStore


def live_tools(store: RunStore) -> list[dict[str, Any]]:
    """One entry per tool name over all live workers, sorted by name."""
    tools: dict[str, dict[str, Any]] = {}
    for worker, info in sorted(store.live_workers().items()):
        for tool in info.get("tools", []):
            entry = tools.setdefault(tool["name"], {
                "name": tool["name"], "source": tool.get("source", "python"),
                "description": tool.get("description", ""), "workers": [],
                "approval": bool(tool.get("approval")),  # each call waits for a person
            })  # fmt: skip
            entry["workers"].append(worker)
    return [tools[name] for name in sorted(tools)]


def tools_rows(entries: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = [("tool", "source", "approval", "workers", "description")]
    for entry in entries:
        first_line = (entry["description"] or "").strip().splitlines()[:1]
        rows.append((entry["name"], entry["source"], "yes" if entry.get("approval") else "-",
                     ",".join(entry["workers"]), first_line[0][:60] if first_line else ""))  # fmt: skip
    return rows


def unavailable_servers(store: RunStore) -> list[dict[str, str]]:
    """MCP servers a live worker could not list (none of their tools is in its catalog),
    with why: one entry per server and worker."""
    return [{"server": server, "worker": worker, "error": why}
            for worker, info in sorted(store.live_workers().items())
            for server, why in sorted(info.get("mcp_unavailable", {}).items())]  # fmt: skip
