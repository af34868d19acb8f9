"""The run console: every run of a tenant, live, in a browser, with its controls.

Served by the operator API's app (``tooloop api``) at ``/``: pages rendered on the server
(Jinja2, ``templates/``), kept live by one small script (``static/console.js``) that
follows the API's event stream and swaps in fragments the server renders. No build step,
no CDN: the package's files are all it needs. See docs/console.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from orchestrator.console import actions, pages
from orchestrator.console.auth import Sessions
from orchestrator.console.web import (
    STATIC,
    ConsoleState,
    RunNotFound,
    SignInNeeded,
    on_run_not_found,
    on_sign_in_needed,
    static_version,
)

if TYPE_CHECKING:
    from orchestrator.api_state import ApiState

__all__ = ["install"]


def install(
    app: FastAPI,
    api: ApiState,
    follow: Callable[..., Any],
    secret_key: str = "",
    insecure_local: bool = False,
) -> None:
    """Serve the console on ``app``, over the API's state (client, tokens) and event stream."""
    sessions = Sessions(api.tokens, secret_key, insecure_local)
    app.state.console = ConsoleState(
        api=api, sessions=sessions, follow=follow, static_version=static_version()
    )
    app.add_exception_handler(SignInNeeded, on_sign_in_needed)
    app.add_exception_handler(RunNotFound, on_run_not_found)
    app.include_router(pages.router)
    app.include_router(actions.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="console-static")
