"""Log lines that say which run they concern: ``TOOLOOP_LOG_FORMAT=json``.

The worker binds a run's ``run_id``, ``iteration`` and ``tool`` while it executes
one of its steps (a context variable: per thread on the turn pools, per process on
the tool pool); ``JsonFormatter`` writes them, and the run's ``trace_id``, on every
line logged meanwhile, so a log search by run id or by trace id finds the same lines.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

# Task ids name their step (see worker/app.py): lines Celery logs outside a task's own
# context ("Task tooloop.turn[turn-<run>-<n>-<generation>] received") still say which run they concern.
TASK_ID = re.compile(r"(?P<kind>turn|tool)-(?P<run>[A-Za-z0-9_-]+?)-(?P<iteration>\d+)(\.\d+)?-(?P<gen>\d+)")
_run: ContextVar[dict[str, Any] | None] = ContextVar("tooloop_log_run", default=None)


def bind(prefix: str, run_id: str, iteration: int | None = None, tool: str | None = None) -> Any:
    """Tag this context's log lines with a run; returns the token ``unbind`` takes."""
    from orchestrator.telemetry import trace_id_hex

    fields = {"run_id": run_id, "iteration": iteration, "tool": tool,
              "trace_id": trace_id_hex(prefix, run_id)}  # fmt: skip
    return _run.set({k: v for k, v in fields.items() if v is not None})


def unbind(token: Any) -> None:
    _run.reset(token)


@contextmanager
def bound(prefix: str, run_id: str, iteration: int | None = None, tool: str | None = None) -> Iterator[None]:
    token = bind(prefix, run_id, iteration, tool)
    try:
        yield
    finally:
        unbind(token)


def current() -> dict[str, Any]:
    return dict(_run.get() or {})


def from_task_id(record: logging.LogRecord) -> dict[str, Any]:
    """The run of a line about a tooloop task, read from the task id it names."""
    task_id = getattr(record, "task_id", None)
    if not task_id and isinstance(record.args, dict):
        task_id = record.args.get("id")
    match = TASK_ID.fullmatch(task_id) if isinstance(task_id, str) else None
    if match is None:
        return {}
    from orchestrator.settings import get_settings
    from orchestrator.telemetry import trace_id_hex

    run_id = match["run"]
    return {"run_id": run_id, "iteration": int(match["iteration"]),
            "trace_id": trace_id_hex(get_settings().key_prefix, run_id)}  # fmt: skip


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the run's fields, the error."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.processName if record.processName != "MainProcess" else record.process,
            **(current() or from_task_id(record)),
        }
        for name in ("task_name", "task_id"):  # Celery's task logger adds these
            value = getattr(record, name, None)
            if value and value != "???":
                line[name] = value
        if record.exc_info:  # exc_text: the traceback as the scrub filter left it
            line["error"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def use_json(logger: logging.Logger | None = None) -> None:
    """Give every handler of ``logger`` (the root logger by default) the JSON format."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        handler.setFormatter(JsonFormatter())
