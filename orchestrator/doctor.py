"""``tooloop doctor``: what is live — Redis, queues, workers, sandbox layers."""

from __future__ import annotations

import time
from typing import Any

from orchestrator.settings import get_settings
from orchestrator.store import RunStore


def diagnose(store: RunStore | None = None, celery_app: Any = None) -> dict[str, Any]:
    """The report (the console's fleet page shows the same, from its own store and app)."""
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
    keys = store.keys
    report["queues"] = _queue_depths(settings, [keys.turn_queue, keys.tool_queue], celery_app)
    now = time.time()
    report["workers"] = {
        name: {
            "queues": w.get("queues", []),
            "tools": len(w.get("tools", [])),
            "sandbox": w.get("sandbox", {}),
            "sandbox_off": w.get("sandbox_off", {}),  # layer -> why it is off
            "seen_s_ago": round(now - w.get("seen", now), 1),
        }
        for name, w in store.live_workers().items()
    }
    report["leases_due"] = store.leases_due()
    return report


def sandbox_report(store: RunStore) -> dict[str, Any]:
    """Per live worker that serves tools: the sandbox layers live, and why the others are not
    (``/api/health``)."""
    return {
        name: {"live": sorted(k for k, on in w.get("sandbox", {}).items() if on),
               "off": w.get("sandbox_off", {})}
        for name, w in store.live_workers().items()
        if "sandbox" in w
    }  # fmt: skip


def _queue_depths(settings: Any, queues: list[str], celery_app: Any = None) -> dict[str, Any]:
    """From the broker itself (RabbitMQ or Redis): messages waiting in each queue."""
    from worker.app import make_app
    from worker.broker import queue_depths

    try:
        return {q: n or 0 for q, n in queue_depths(celery_app or make_app(settings), queues).items()}
    except Exception as exc:  # the broker is down: say so, keep the rest of the report
        return {q: f"broker unreachable ({exc})" for q in queues}


def render(report: dict[str, Any]) -> None:
    from rich.console import Console

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
    if not report["workers"]:
        console.print("[yellow]no live workers[/yellow]")
    for name, w in report["workers"].items():
        layers = ", ".join(k for k, on in w["sandbox"].items() if on) or "-"
        console.print(f"worker {name}: queues={','.join(w['queues'])} tools={w['tools']} "
                      f"sandbox={layers} seen {w['seen_s_ago']}s ago")  # fmt: skip
        for layer, why in w.get("sandbox_off", {}).items():
            console.print(f"  [yellow]{layer} off[/yellow]: {why}", markup=True, highlight=False)
