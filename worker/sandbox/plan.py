"""Planning a call, in the worker before the fork: its layer, its folder, its
environment (an allowlist) and, for the exec layers, what runs the runner (bwrap's
command line included)."""

from __future__ import annotations

import json
import os
import pickle
import pwd
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from worker.sandbox.constants import ALLOWED_COMMANDS_ENV, ENV_PASSTHROUGH, MODES, SYSTEM_PATH
from worker.sandbox.context import SandboxContext, SandboxError
from worker.sandbox.folders import _prepare, _sandbox_root
from worker.sandbox.host import _BASE_MOUNTS, _host, _mode
from worker.sandbox.paths import _ancestors, _inside, _python_paths
from worker.sandbox.runner import _runner_source

if TYPE_CHECKING:
    from orchestrator.models import SandboxPolicy


@dataclass
class _Plan:
    layer: str  # fork | exec | bwrap
    workdir: str  # real path of the run folder
    gid: int | None  # the run's group when the worker is root
    policy: SandboxPolicy
    env: dict[str, str]
    argv: list[str] = field(default_factory=list)  # exec layers: what runs the runner
    target: tuple[str, str] = ("", "")  # exec layers: module and qualname of the tool
    kwargs_blob: bytes = b""  # exec layers: the arguments, pickled


def _plan(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext) -> _Plan:
    mode = _mode(ctx.mode)
    if mode not in MODES:
        raise SandboxError(f"TOOLOOP_SANDBOX={mode!r}: use one of {', '.join(MODES)}")
    layer = _layer(mode, ctx.strict)
    root = _sandbox_root(ctx.sandbox_root)
    gid = _prepare(ctx.workdir, root)
    workdir = _checked_workdir(ctx.workdir)
    plan = _Plan(layer, workdir, gid, ctx.policy, _environment(workdir, layer, ctx.policy))
    if layer != "fork":
        plan.target = _importable(fn)
        plan.kwargs_blob = _pickled(kwargs)
        plan.argv = _runner_argv(plan, root)
    return plan


def _layer(mode: str, strict: bool) -> str:
    if mode == "basic":
        return "exec" if strict else "fork"
    bwrap = _host(probe=True).bwrap is not None
    if mode == "bwrap":
        if not bwrap:
            raise SandboxError(f"TOOLOOP_SANDBOX=bwrap but {_host(probe=True).bwrap_error}")
        return "bwrap"
    if not strict:
        return "fork"
    return "bwrap" if bwrap else "exec"


@lru_cache(maxsize=256)
def _checked_workdir(path: str) -> str:
    """The real path of a run folder, never one holding the worker's own code (it is
    handed to the model). Cached: the calls of a run come to the same worker process."""
    workdir = os.path.realpath(path)
    here = os.path.abspath(__file__)  # <the worker's code>/worker/sandbox/plan.py
    for code in [*_python_paths(), os.path.dirname(os.path.dirname(os.path.dirname(here)))]:
        if _inside(code, workdir):
            raise SandboxError(f"run folder {workdir} contains the worker's code ({code})")
    return workdir


def _environment(workdir: str, layer: str, policy: SandboxPolicy) -> dict[str, str]:
    """The allowlist: nothing of the worker's environment (API keys, TOOLOOP_*) gets in."""
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:{SYSTEM_PATH}",
        "HOME": workdir,
        "TMPDIR": "/tmp" if layer == "bwrap" else workdir,  # /tmp is private only under bwrap
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }
    env.update({k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ})
    if policy.allowed_commands is not None:
        env[ALLOWED_COMMANDS_ENV] = json.dumps(policy.allowed_commands)
    return env


def _importable(fn: Callable[..., Any]) -> tuple[str, str]:
    """Module and qualname that find ``fn`` again in a fresh interpreter."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    found: Any = sys.modules.get(module or "")
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if module in (None, "__main__") or found is not fn:
        raise SandboxError(
            f"{module}.{qualname} cannot run in a fresh interpreter: strict tools must be "
            "module-level functions of an importable module"
        )
    return module, qualname


def _pickled(kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps(kwargs)
    except Exception as exc:
        raise SandboxError(f"the arguments cannot be sent into the sandbox: {exc}") from exc


def _runner_argv(plan: _Plan, root: str) -> list[str]:
    python = [sys.executable, "-I", "-S", "-B", "-c", _runner_source()]
    if plan.layer == "exec":
        return python
    return [*_bwrap_argv(plan, root), "--", *python]


def _bwrap_argv(plan: _Plan, sandbox_root: str) -> list[str]:
    """Read-only host, then empty tmpfs over what the call must not see, then back
    (read-only) what it needs from under them, then the run folder (writable)."""
    host = _host(probe=True)
    assert host.bwrap is not None
    argv = [host.bwrap, *host.bwrap_flags]
    if not plan.policy.network:
        argv.append("--unshare-net")
    argv += _BASE_MOUNTS
    masks = ["/tmp", *_masks()]
    for path in masks[1:]:
        argv += ["--tmpfs", path]
    binds = _binds_under(masks, plan.policy.network)
    for path in binds:
        argv += [*_parents(path, masks), "--ro-bind", path, path]
    masks += binds
    runs = os.path.realpath(sandbox_root)  # every run's folder: hidden, after the binds
    argv += [*_parents(runs, masks), "--tmpfs", runs]
    masks.append(runs)
    argv += [*_parents(plan.workdir, masks), "--bind", plan.workdir, plan.workdir]
    return [*argv, "--chdir", plan.workdir]


def _masks() -> list[str]:
    """/run (daemon sockets) and what hides Python from the sandbox uid; parents first."""
    masks = set(_python_masks())
    if os.path.isdir("/run") and not os.path.islink("/run"):
        masks.add("/run")
    return sorted(masks, key=lambda p: (p.count("/"), p))


def _parents(path: str, masks: list[str]) -> list[str]:
    """Searchable folders between the innermost mask holding ``path`` and ``path``
    (bwrap would create them 0700: the sandbox uid could not walk through)."""
    holders = [m for m in masks if _inside(path, m) and m != path]
    if not holders:
        return []
    mask = max(holders, key=len)
    between = [a for a in _ancestors(os.path.dirname(path)) if _inside(a, mask) and a != mask]
    return [arg for folder in between for arg in ("--perms", "0755", "--dir", folder)]


@lru_cache(maxsize=1)
def _python_masks() -> frozenset[str]:
    if os.geteuid() != 0:  # bwrap runs as the worker's user: hide its home instead
        home = os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir or "/")
        return frozenset({home} if home != "/" and os.path.isdir(home) else set())
    masks = set()
    for path in _python_paths():
        blocking = [a for a in _ancestors(path) if not os.stat(a).st_mode & stat.S_IXOTH]
        if blocking:
            masks.add(blocking[0])
    return frozenset(masks)


def _binds_under(masks: list[str], network: bool) -> list[str]:
    """Python paths (and DNS config when the network is on) hidden by a mask."""
    wanted = list(_python_paths())
    if network and os.path.exists("/etc/resolv.conf"):
        wanted.append(os.path.realpath("/etc/resolv.conf"))
    return [p for p in wanted if any(_inside(p, m) for m in masks)]
