"""The fork layer's child is a copy of the worker's heap: before the tool runs, it drops
what the worker holds that a tool must not (issue 15): the sealing key and its Fernet
objects, the Redis and broker URLs (passwords included), the API tokens, the worker's
Redis client and Celery connection pools.

This drops *references*: a default ``@tool`` that looks for the worker's settings,
store or Celery app finds them empty. The bytes stay in the copied memory until they
are overwritten, and a tool that runs code it is given (``eval``, plugins, a model's
script) can scan its own memory: such a tool must be ``@tool(sandbox="strict")`` (a
fresh interpreter: nothing of the worker's memory). The built-ins always are.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

SECRET_FIELDS = ("secret_key", "redis_url", "broker_url", "api_tokens")  # of orchestrator.settings.Settings
CELERY_URLS = ("broker_url", "result_backend", "broker_read_url", "broker_write_url")


def forget_worker_state() -> None:
    """In the forked call's process, before the tool runs (cheap: a few objects touched)."""
    settings: list[Any] = []
    module = sys.modules.get("orchestrator.settings")
    if module is not None and module.get_settings.cache_info().currsize:
        settings.append(module.get_settings())
        module.get_settings.cache_clear()  # a tool asking again gets its own scrubbed environment's
    app_module = sys.modules.get("worker.app")
    if app_module is not None:
        settings.append(getattr(app_module.app, "tooloop_settings", None))
        if app_module.get_store.cache_info().currsize:
            forget_client(app_module.get_store().redis)
            app_module.get_store.cache_clear()
        _forget_celery(app_module.app)
    for found in settings:
        if found is not None:
            for name in SECRET_FIELDS:
                found.__dict__[name] = ""  # (pydantic keeps field values in __dict__)
    secrets = sys.modules.get("orchestrator.secrets")
    if secrets is not None:
        secrets._fernet.cache_clear()  # Fernet objects derived from the sealing key


def _forget_celery(app: Any) -> None:
    """The Celery app: its broker and backend URLs, its connection, producer and backend pools."""
    for layer in (getattr(app, "_preconf", None), getattr(app, "_conf", None)):
        for key in CELERY_URLS:
            with contextlib.suppress(Exception):  # (a configuration not loaded: nothing in it)
                if layer is not None and key in layer:
                    layer[key] = None
    app.__dict__["_pool"] = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp.__dict__["_producer_pool"] = None
    for backend in (app.__dict__.get("_backend_cache"), getattr(app.__dict__.get("_local"), "backend", None)):
        if backend is not None:
            backend.__dict__["url"] = None
            _forget_kwargs(getattr(backend, "connparams", None))
            forget_client(backend.__dict__.get("client"))
    pools = sys.modules.get("kombu.pools")
    if pools is not None:  # (dict.clear: closing them would talk to the broker)
        for group in (pools.connections, pools.producers):
            dict.clear(group)


def forget_client(client: Any) -> None:
    from orchestrator.connections import forget_credentials  # (loaded where there is a client)

    forget_credentials(client)


def _forget_kwargs(kwargs: Any) -> None:
    from orchestrator.connections import CONNECTION_FIELDS

    if isinstance(kwargs, dict):
        for key in CONNECTION_FIELDS:
            kwargs.pop(key, None)
