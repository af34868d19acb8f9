"""``tooloop doctor``: what is live — Redis, queues, workers, sandbox layers."""

from __future__ import annotations

import time
from typing import Any

from orchestrator.settings import Settings, get_settings
from orchestrator.store import RunStore

NO_KEY = ("sealed values do not open here: a tool call whose arguments hold a secret fails "
          "(SecretError), and so does a turn whose spec has a sealed credential")


def diagnose(store: RunStore | None = None) -> dict[str, Any]:
    """The report (the console's fleet page shows the same, from its own store)."""
    settings = store.settings if store else get_settings()
    store = store or RunStore.from_settings(settings)
    report: dict[str, Any] = {"redis": {"url": settings.redis_url, "ok": False}}
    try:
        info = store.redis.info()
        config = store.redis.config_get("maxmemory-policy")
    except Exception as exc:
        report["redis"]["error"] = str(exc)
        return report
    report["redis"].update(
        ok=True,
        version=info.get("redis_version"),
        aof=bool(info.get("aof_enabled")),
        maxmemory_policy=config.get("maxmemory-policy"),
    )
    report["queues"] = _queue_depths(settings, store)
    now = time.time()
    report["workers"] = {
        name: {
            "queues": w.get("queues", []),
            "tools": len(w.get("tools", [])),
            "sandbox": w.get("sandbox", {}),
            "sandbox_off": w.get("sandbox_off", {}),  # layer -> why it is off
            "mcp_unavailable": w.get("mcp_unavailable", {}),  # MCP server -> why its tools are missing
            "seen_s_ago": round(now - w.get("seen", now), 1),
            # without it, sealed tool arguments and credentials do not open there
            "secret_key": w.get("secret_key"),
        }
        for name, w in store.live_workers().items()
    }
    report["leases_due"] = store.leases_due()
    report["tenants"] = tenant_shares(store)
    return report


def tenant_shares(store: RunStore) -> list[dict[str, Any]]:
    """Under fair share, each tenant's active and waiting runs and its token share over the
    last minute (orchestrator/fairshare.py); [] when fair share is off."""
    from dataclasses import asdict

    from orchestrator import fairshare

    fair = fairshare.of(store)
    return [asdict(share) for share in fair.shares()] if fair else []


def sandbox_report(store: RunStore) -> dict[str, Any]:
    """Per live worker that serves tools: the sandbox layers live, and why the others are not
    (``/api/health``)."""
    return {
        name: {"live": sorted(k for k, on in w.get("sandbox", {}).items() if on),
               "off": w.get("sandbox_off", {})}
        for name, w in store.live_workers().items()
        if "sandbox" in w
    }  # fmt: skip


def _queue_depths(settings: Settings, store: RunStore) -> dict[str, Any]:
    """What waits in the turn and tool queues, counted in the broker itself (the Redis lists
    behind kombu's queues, every priority and each tool's own queue; RabbitMQ's message
    counts), as the metrics count it."""
    from orchestrator.metrics import queue_depths

    try:
        return queue_depths(settings, store.redis)
    except Exception as exc:  # the broker is down: say so, keep the rest of the report
        keys = store.keys
        return {q: f"broker unreachable ({exc})" for q in (keys.turn_queue, keys.tool_queue)}


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    redis = report["redis"]
    if not redis["ok"]:
        console.print(f"[red]Redis {redis['url']}: {redis.get('error')}[/red]")
        return
    policy_ok = redis["maxmemory_policy"] == "noeviction"
    console.print(f"Redis {redis['url']} v{redis['version']}  aof={redis['aof']}  "
                  f"maxmemory-policy={redis['maxmemory_policy']}"
                  + ("" if policy_ok else "  [yellow](use noeviction)[/yellow]"))  # fmt: skip
    for queue, depth in report["queues"].items():
        console.print(f"queue {queue}: {depth} waiting")
    for t in report.get("tenants", []):
        cap = "" if t["cap"] is None else f" of {t['cap']}"
        console.print(f"tenant {escape(t['tenant'])}: {t['active']} active{cap}, {t['waiting']} waiting, "
                      f"weight {t['weight']:g}, {t['tokens_minute']} tokens last minute "
                      f"({t['share']:.0%})", markup=False, highlight=False)  # fmt: skip
    if not report["workers"]:
        console.print("[yellow]no live workers[/yellow]")
    for name, w in report["workers"].items():
        layers = ", ".join(k for k, on in w["sandbox"].items() if on) or "-"
        console.print(f"worker {name}: queues={','.join(w['queues'])} tools={w['tools']} "
                      f"sandbox={layers} seen {w['seen_s_ago']}s ago")  # fmt: skip
        for layer, why in w.get("sandbox_off", {}).items():
            console.print(f"  [yellow]{layer} off[/yellow]: {why}", markup=True, highlight=False)
        for server, why in w.get("mcp_unavailable", {}).items():
            console.print(f"  [yellow]MCP server {escape(server)!r} unavailable[/yellow]: {escape(why)}",
                          markup=True, highlight=False, soft_wrap=True)  # fmt: skip
        if w.get("secret_key") is False:
            console.print(f"  [yellow]no TOOLOOP_SECRET_KEY[/yellow]: {NO_KEY}", markup=True, highlight=False)
