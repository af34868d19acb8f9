"""The exec layers' runner: source shipped to a fresh ``python -I -S -B -c``.

These functions run in the sandbox, not in the worker: standard library only,
imported inside them, so the sandbox never imports this module (nor pydantic).
``_runner_source()`` is that source: these functions, then a call of ``_runner_main``."""

from __future__ import annotations

import inspect
import textwrap
from functools import lru_cache

from worker.sandbox.kernel import _landlock_apply, _seccomp_load


def _runner_main() -> None:
    import faulthandler
    import json  # noqa: F401  (before the drop: the call's uid may not read the stdlib)
    import os
    import pickle
    import sys

    null = os.open("/dev/null", os.O_RDWR)
    crash = os.dup(2)  # the worker's pipe, kept for the interpreter's own report if the tool dies
    os.dup2(null, 2)  # what failed before this line (bwrap, the interpreter) is the worker's to read
    chunks = [os.read(0, 1 << 20)]
    while chunks[-1]:
        chunks.append(os.read(0, 1 << 20))
    request = pickle.loads(b"".join(chunks))
    os.dup2(null, 0)
    os.close(null)
    sys.path[:] = request["path"]
    code, payload = 1, None
    try:
        fn = _runner_import(request["module"], request["qualname"])
        kwargs = pickle.loads(request["kwargs"])
        confine = request["confine"]  # under bwrap: Landlock and seccomp, applied here
        if confine and confine["landlock"]:
            _landlock_apply(confine["landlock"], confine["net_fd"])
        if confine and confine["bpf"]:
            _seccomp_load(confine["bpf"])
        if request["drop"]:
            _runner_drop(*request["drop"], request["parent"])
        if request["chdir"]:  # under bwrap: the run's folder, entered as the call's uid
            os.chdir(request["chdir"])
    except BaseException as exc:
        payload = {
            "error": f"SandboxError: cannot start the tool: {type(exc).__name__}: {exc}",
            "failed_start": True,
        }  # (constants.FAILED_START: this source imports nothing)
    if payload is None:
        # From here what the pipe gets is the tool's crash, not a failed start (the worker
        # splits on this mark: constants.STARTED_MARK): a fatal signal's report and traceback.
        os.write(crash, b"\n[tooloop: the tool started]\n")
        faulthandler.enable(file=crash)
        payload, code = _runner_call(fn, kwargs), 0
    _runner_report(payload)
    if request["drop"] and os.getuid() != 0:
        try:  # noqa: SIM105  (contextlib would cost an import here)
            os.kill(-1, 9)  # whatever the tool started, escaped sessions included
        except ProcessLookupError:
            pass
    os._exit(code)


def _runner_import(module: str, qualname: str) -> object:
    """The tool's function. ``worker.registry`` is first replaced by pass-through
    decorators (the sandbox needs the function, not its schema: no pydantic import);
    a module that needs more of it is imported again for real."""
    import importlib
    import sys
    import types

    before = set(sys.modules)
    stub = types.ModuleType("worker.registry")
    stub.tool = lambda fn=None, /, **_: fn if fn is not None else (lambda f: f)
    stub.builtin_tool = lambda fn: fn
    stub.Tool = stub.ToolDef = object
    stub.REGISTRY = {}
    sys.modules.setdefault("worker.registry", stub)
    try:
        found = importlib.import_module(module)
    except (ImportError, AttributeError):
        for name in set(sys.modules) - before:
            del sys.modules[name]
        found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _runner_drop(uid: int, gid: int, parent: int | None) -> None:
    import ctypes
    import os

    os.setgroups([gid])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise PermissionError("still able to become root after dropping privileges")
    if parent is not None:  # outside bwrap nothing else ties this process to the worker
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)


def _runner_call(fn: object, kwargs: dict) -> dict:
    import json

    try:
        value = fn(**kwargs)
    except BaseException as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = str(value)
    return {"ok": value}


def _runner_report(payload: dict) -> None:
    import json
    import os

    data = json.dumps(payload).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[os.write(3, view) :]


_RUNNER_FUNCTIONS = (_landlock_apply, _seccomp_load, _runner_import, _runner_drop, _runner_call,
                     _runner_report, _runner_main)  # fmt: skip


@lru_cache(maxsize=1)
def _runner_source() -> str:
    parts = [textwrap.dedent(inspect.getsource(f)) for f in _RUNNER_FUNCTIONS]
    return "from __future__ import annotations\n\n" + "\n\n".join(parts) + "\n_runner_main()\n"
