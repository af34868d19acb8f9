"""The Celery app (``celery -A worker.app worker|flower``): the process's app
(``orchestrator/dispatch.py``: its settings, queues and routes, and how steps are
sent), with the worker's task modules to load at start.

Importing this module is cheap: it neither imports the task modules (the worker
does, at start) nor litellm.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from orchestrator.broker import declare_all, is_amqp
from orchestrator.dispatch import (
    TOOL_TASK,
    TURN_TASK,
    app_for,
    call_queue,
    call_task_id,
    default_app,
    enqueue_call,
    enqueue_turn,
    make_app,
    send,
    turn_task_id,
)
from orchestrator.scrub import install_log_filter
from worker import observe  # noqa: F401  (its Celery signals: spans, metrics and run-tagged logs of each task)
from worker.runtime import get_store

__all__ = [
    "TOOL_TASK",
    "TURN_TASK",
    "app",
    "app_for",
    "call_queue",
    "call_task_id",
    "enqueue_call",
    "enqueue_turn",
    "get_store",
    "make_app",
    "send",
    "turn_task_id",
]

app = default_app()
app.conf.update(
    include=["worker.maintenance", "worker.turn", "worker.tool_task", "worker.supervision"],
    imports=["worker.builtins", *app.tooloop_settings.tool_modules],  # type: ignore[attr-defined]
)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _scrub_logs(logger: logging.Logger, **_: Any) -> None:
    """Every handler Celery sets up masks secrets in log lines (see orchestrator.scrub)."""
    install_log_filter(logger, logging.getLogger())


@signals.celeryd_after_setup.connect
def _declare_before_delayed_delivery(sender: str, instance: Any, **_: Any) -> None:
    """RabbitMQ: every queue declared before Celery binds them (orchestrator/broker.py)."""
    if is_amqp(instance.app.conf.broker_url or ""):
        declare_all(instance.app)
