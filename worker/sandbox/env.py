"""The environment allowlist: all that a call, or the fork server that forks calls, gets
of the worker's environment.

Built from nothing, never as "the worker's minus a denylist": whatever the worker has
(``REDIS_PASSWORD`` from a manifest, a provider's key, ``TOOLOOP_*``, a variable an
operator exported for something else) reaches neither a call nor the fork server, whose
memory every forked call copies. A forked process (a copy of one that had more) is
scrubbed down to the allowlist in place (``scrub``); everything else is started with it.
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from worker.sandbox.constants import ALLOWED_COMMANDS_ENV, ENV_PASSTHROUGH, EXECUTORS_ENV, SYSTEM_PATH

if TYPE_CHECKING:
    from orchestrator.models import SandboxPolicy


def base_environment() -> dict[str, str]:
    """What any sandboxed process may have: a ``PATH`` (this Python's folder first), a
    locale, a terminal type, and the worker's ``LANG``/``LC_ALL``/``LC_CTYPE``/``TZ``."""
    env = {"PATH": f"{os.path.dirname(sys.executable)}:{SYSTEM_PATH}", "LANG": "C.UTF-8", "TERM": "dumb"}
    env.update({k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ})
    return env


def call_environment(workdir: str, tmp: str, policy: SandboxPolicy) -> dict[str, str]:
    """One call's: the base, its folder as ``HOME``, its temp folder, and what the shell
    built-in reads of its policy."""
    _clearenv()  # (for scrub, in a forked call's process)
    env = base_environment()
    env.update({"HOME": workdir, "TMPDIR": tmp, "TMP": tmp, "TEMP": tmp, "TEMPDIR": tmp})
    if policy.allowed_commands is not None:
        env[ALLOWED_COMMANDS_ENV] = json.dumps(policy.allowed_commands)
        env[EXECUTORS_ENV] = json.dumps(_shell_executors())
    return env


def _shell_executors() -> list[str]:
    from orchestrator.settings import get_settings

    return [n.strip() for n in get_settings().shell_executors.split(",") if n.strip()]


def scrub(allowed: dict[str, str]) -> None:
    """In a forked process: its environment becomes exactly ``allowed``. The keys are
    listed now, not from a list taken earlier (a variable set since would stay); the C
    library's own copy is cleared too (a C extension's ``setenv`` bypasses ``os.environ``).
    (Not ``os.environ.clear()``: it copies the key list once per key, ~1 ms here.)"""
    for key in [k for k in os.environ if k not in allowed]:
        del os.environ[key]
    _clearenv()()
    os.environ.update(allowed)  # (putenv for each: the C copy holds the allowlist alone)


@lru_cache(maxsize=1)
def _clearenv() -> Any:
    """libc's ``clearenv``, looked up before the fork (``call_environment`` does): in the
    call's process a first ctypes lookup costs ~0.3 ms of copy-on-write faults."""
    from worker.sandbox.libc import _libc

    return _libc().clearenv
