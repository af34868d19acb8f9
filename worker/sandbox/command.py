"""A long-lived program (an MCP stdio server) in the sandbox: ``sandboxed_command``.

A tool call's process lives for one call; a server lives for a run, so it cannot be
watched by ``run_call``. Instead its command line is wrapped: a small keeper process
(``python -I -S``, standard library only), given a uid of its own from the same
host-wide counter as a call's, forks the program (through bubblewrap when this host has it)
with the same limits, folder, environment allowlist and uid drop as a strict call,
waits for it, and when it exits or is told to stop, kills every process of that uid
(``kill(-1)``), so nothing the server started survives it.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache

from worker.sandbox.child import _limits
from worker.sandbox.constants import MODES
from worker.sandbox.context import SandboxContext, SandboxError
from worker.sandbox.env import call_environment
from worker.sandbox.folders import _prepare, _sandbox_root, make_tmp, next_uid
from worker.sandbox.host import _mode
from worker.sandbox.kernel import _landlock_apply, _seccomp_load, denied_ports
from worker.sandbox.paths import _module_path
from worker.sandbox.plan import (
    _bwrap_argv,
    _checked_workdir,
    _confinement,
    _hides_runs,
    _layer,
    _Plan,
    _run_roots,
)
from worker.sandbox.quota import room


@dataclass
class Command:
    argv: list[str]  # the keeper, then the program
    env: dict[str, str]  # allowlisted, plus what the caller added
    cwd: str  # the run's folder
    layer: str  # exec | bwrap


def sandboxed_command(argv: list[str], ctx: SandboxContext, env: dict[str, str] | None = None) -> Command:
    """``argv`` wrapped to run in the run's folder as a sandboxed, strict program
    (``ctx.run_id`` names the run whose folder ``ctx.workdir`` must be)."""
    mode = _mode(ctx.mode)
    if mode not in MODES:
        raise SandboxError(f"TOOLOOP_SANDBOX={mode!r}: use one of {', '.join(MODES)}")
    layer = _layer(mode, strict=True)
    root = _sandbox_root(ctx.sandbox_root)
    allow = list(ctx.allow) if ctx.allow is not None else None
    workdir = _checked_workdir(ctx.workdir, ctx.run_id, root, ctx.allow)
    gid = _prepare(workdir, root, ctx.run_id, allow)
    uid = next_uid(root) if gid is not None else None
    tmp = "/tmp" if layer == "bwrap" else make_tmp(workdir, gid)
    full_env = {**call_environment(workdir, tmp, ctx.policy), **(env or {})}
    plan = _Plan(layer, workdir, gid, uid, ctx.policy, full_env)
    roots = _run_roots(root, allow)
    conf = _confinement(workdir, ctx.policy.network, layer, roots if _hides_runs(uid, layer) else ())
    quota = ctx.policy.max_disk_mb << 20  # (a long-lived server: the room at its start bounds each file)
    limits = _limits(ctx.policy, nproc=os.geteuid() == 0, fork=False, room=room(workdir, quota))
    config = {
        "gid": gid,
        "uid": uid,
        "limits": [[which, soft, hard] for which, (soft, hard) in limits],
        "landlock": conf.landlock,
        "bpf": base64.b64encode(conf.bpf).decode() if conf.bpf else None,
        # network on: the keeper builds the ruleset that keeps Redis and the broker away
        # (a descriptor of this process would not survive the MCP SDK's spawn)
        "net_denied": denied_ports() if ctx.policy.network else None,
        "path": list(_module_path()),
        "bwrap": [*_bwrap_argv(plan, roots), "--"] if layer == "bwrap" else None,
        "chdir": workdir if layer == "bwrap" else None,  # entered once it is the program's uid
        "env": sorted(full_env),  # the names it passes on (the SDK adds the host's USER, SHELL...)
        "python": sys.executable,
        "parent": os.getpid(),  # the keeper stops its program when this process dies
        "source": keeper_source() if layer == "bwrap" else "",  # bubblewrap's inner stage
    }
    keeper = [sys.executable, "-I", "-S", "-B", "-c", keeper_source(), json.dumps(config)]
    # Found now, as the worker: the program's uid may not be able to search PATH itself.
    program = shutil.which(argv[0], path=full_env["PATH"]) or argv[0]
    return Command([*keeper, program, *argv[1:]], full_env, workdir, layer)


# -- the keeper: runs in its own interpreter, standard library only -----------------
def _keeper_main() -> None:
    import json
    import os
    import signal
    import sys

    config, argv = json.loads(sys.argv[1]), sys.argv[2:]
    if config.get("inner"):  # inside bubblewrap: limits, the drop, then the program
        _keeper_confine(config)
        try:
            os.execvpe(argv[0], argv, _keeper_env(config))
        except OSError as exc:  # one line that says why (ENOENT, EACCES), as the outer stage's
            sys.stderr.write(f"tooloop sandbox: cannot start {argv[:1]}: {exc}\n")
            os._exit(127)
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PDEATHSIG: the caller died -> stop
    if os.getppid() != config["parent"]:
        os._exit(1)
    if config["net_denied"] is not None:  # as the worker's user, before anything is dropped
        sys.path[:0] = config["path"]
        from worker.sandbox.kernel import net_ruleset

        config["net_fd"] = net_ruleset(config["net_denied"])
        os.set_inheritable(config["net_fd"], True)  # crosses bwrap to the inner stage
    uid = config["uid"]
    pid = os.fork()
    if pid == 0:
        _keeper_child(config, uid, argv)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):  # the program's pipes close when it exits, not when we do
        os.dup2(null, fd)
    signal.signal(signal.SIGTERM, lambda *_: _keeper_kill(pid))
    signal.signal(signal.SIGINT, lambda *_: _keeper_kill(pid))
    status = 0
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    if uid is not None:
        _keeper_kill_uid(uid)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if status else 0)


def _keeper_child(config: dict, uid: int | None, argv: list) -> None:
    import ctypes
    import json
    import os
    import sys

    try:
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PDEATHSIG: dies with the keeper
        if config["bwrap"]:
            inner = {**config, "inner": True, "uid": uid, "source": ""}
            command = [config["python"], "-I", "-S", "-B", "-c", config["source"], json.dumps(inner)]
            os.execve(config["bwrap"][0], [*config["bwrap"], *command, *argv], _keeper_env(config))
        _keeper_confine({**config, "uid": uid})
        os.execvpe(argv[0], argv, _keeper_env(config))
    except BaseException as exc:
        sys.stderr.write(f"tooloop sandbox: cannot start {argv[:1]}: {exc}\n")
    os._exit(127)


def _keeper_confine(config: dict) -> None:
    """Limits, no_new_privs, Landlock and seccomp (the sandbox's own), then the uid drop."""
    import base64
    import ctypes
    import os
    import resource

    for which, soft, hard in config["limits"]:
        resource.setrlimit(which, (soft, hard))
    prctl = ctypes.CDLL(None).prctl
    prctl(38, 1, 0, 0, 0)  # no_new_privs
    if config["landlock"]:
        _landlock_apply(config["landlock"], config.get("net_fd"))
    if config["bpf"]:
        _seccomp_load(base64.b64decode(config["bpf"]))
    if config.get("uid") is not None:
        gid, uid = config["gid"], config["uid"]
        os.setgroups([gid])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        prctl(1, 9, 0, 0, 0)  # PDEATHSIG again: the drop cleared it
    if config.get("chdir"):  # inside bubblewrap: the run's folder, entered as the program's uid
        os.chdir(config["chdir"])


def _keeper_env(config: dict) -> dict:
    """The allowlisted environment alone: the MCP SDK adds the host's USER, SHELL...,
    bubblewrap its PWD."""
    import os

    return {k: os.environ[k] for k in config["env"] if k in os.environ}


def _keeper_kill(pid: int) -> None:
    import os

    try:  # noqa: SIM105  (contextlib would cost an import here)
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _keeper_kill_uid(uid: int) -> None:
    """``kill(-1)`` as the program's uid: whatever it started, escaped sessions included."""
    import os

    child = os.fork()
    if child == 0:
        try:
            os.setresuid(uid, uid, uid)
            if uid != 0:
                os.kill(-1, 9)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


_KEEPER_FUNCTIONS = (_landlock_apply, _seccomp_load, _keeper_child, _keeper_confine, _keeper_env,
                     _keeper_kill, _keeper_kill_uid, _keeper_main)  # fmt: skip


@lru_cache(maxsize=1)
def keeper_source() -> str:
    parts = [textwrap.dedent(inspect.getsource(f)) for f in _KEEPER_FUNCTIONS]
    return "from __future__ import annotations\n\n" + "\n\n".join(parts) + "\n_keeper_main()\n"
