"""Planning a call, in the worker before the fork: its layer, its folder, its
environment (an allowlist) and, for the exec layers, what runs the runner (bwrap's
command line included)."""

from __future__ import annotations

import contextlib
import os
import pickle
import pwd
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from worker.sandbox.constants import MODES
from worker.sandbox.context import SandboxContext, SandboxError
from worker.sandbox.env import call_environment
from worker.sandbox.folders import _allowed, _prepare, _sandbox_root, checked_folder, make_tmp, next_uid
from worker.sandbox.host import _BASE_MOUNTS, _host, _mode
from worker.sandbox.kernel import Confinement, confinement
from worker.sandbox.paths import _ancestors, _inside, _python_paths
from worker.sandbox.quota import room
from worker.sandbox.runner import _runner_source

if TYPE_CHECKING:
    from orchestrator.models import SandboxPolicy


@dataclass
class _Plan:
    layer: str  # fork | exec | bwrap
    workdir: str  # real path of the run folder
    gid: int | None  # the run's group when the worker is root
    uid: int | None  # the call's own uid when the worker is root (host-wide counter)
    policy: SandboxPolicy
    env: dict[str, str]
    confine: Confinement | None = None  # Landlock and seccomp, applied by the call's process
    argv: list[str] = field(default_factory=list)  # exec layers: what runs the runner
    target: tuple[str, str] = ("", "")  # exec layers: module and qualname of the tool
    kwargs_blob: bytes = b""  # exec layers: the arguments, pickled
    quota: int = 0  # bytes the run's folder may hold (policy.max_disk_mb)
    room: int | None = None  # bytes the call may still write there (its RLIMIT_FSIZE at most)


def _plan(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext) -> _Plan:
    mode = _mode(ctx.mode)
    if mode not in MODES:
        raise SandboxError(f"TOOLOOP_SANDBOX={mode!r}: use one of {', '.join(MODES)}")
    layer = _layer(mode, ctx.strict)
    root = _sandbox_root(ctx.sandbox_root)
    allow = list(ctx.allow) if ctx.allow is not None else None
    workdir = _checked_workdir(ctx.workdir, ctx.run_id, root, ctx.allow)  # before anything is touched
    gid = _prepare(workdir, root, ctx.run_id, allow)
    uid = next_uid(root) if gid is not None else None
    tmp = "/tmp" if layer == "bwrap" else make_tmp(workdir, gid)  # /tmp is private only under bwrap
    plan = _Plan(layer, workdir, gid, uid, ctx.policy, call_environment(workdir, tmp, ctx.policy))
    plan.quota = ctx.policy.max_disk_mb << 20
    plan.room = room(workdir, plan.quota)
    roots = _run_roots(root, allow)
    plan.confine = _confinement(workdir, ctx.policy.network, layer, roots if _hides_runs(uid, layer) else ())
    if layer != "fork":
        plan.target = _importable(fn)
        plan.kwargs_blob = _pickled(kwargs)
        plan.argv = _runner_argv(plan, roots)
    return plan


def _hides_runs(uid: int | None, layer: str) -> bool:
    """A call without a uid of its own shares the worker's user with every other run's
    calls: only Landlock keeps it out of their folders (bwrap hides them by its mounts)."""
    return uid is None and layer != "bwrap"


def _run_roots(root: str, allow: list[str] | None) -> tuple[str, ...]:
    """The folders that hold the folders of all runs (the sandbox root, every allowed root):
    what bwrap hides, and, for a call without a uid of its own (the worker is not root:
    every call is the worker's user), what Landlock keeps out of reach outside bwrap."""
    return tuple(sorted({os.path.realpath(root), *_allowed(allow)}))


def _confinement(workdir: str, network: bool, layer: str, hidden: tuple[str, ...] = ()) -> Confinement:
    """Landlock and seccomp for this call. A call with network on must still never reach
    Redis or the broker: without Landlock's TCP rules (ABI >= 4) it is refused."""
    conf = confinement(workdir, network, layer == "bwrap", hidden)
    if network and conf.net_fd is None:
        why = "; ".join(conf.missing) or "Landlock ABI < 4 (no TCP rules)"
        raise SandboxError(f"policy.network is on, but this host cannot keep tool calls away from Redis "
                           f"and the broker ({why}): refused")  # fmt: skip
    return conf


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
def _checked_workdir(path: str, run_id: str | None, root: str, allow: tuple[str, ...] | None) -> str:
    """The real path of a run folder: inside the operator's roots (the sandbox root's
    ``<run_id>``, or inside a TOOLOOP_SANDBOX_ALLOW folder), never one holding the
    worker's own code (it is handed to the model). Cached: the calls of a run come to
    the same worker process, and the folders on the way are root's or the operator's."""
    workdir = checked_folder(path, run_id, root, list(allow) if allow is not None else None)
    here = os.path.abspath(__file__)  # <the worker's code>/worker/sandbox/plan.py
    for code in [*_python_paths(), os.path.dirname(os.path.dirname(os.path.dirname(here)))]:
        if _inside(code, workdir):
            raise SandboxError(f"run folder {workdir} contains the worker's code ({code})")
    return workdir


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


def _runner_argv(plan: _Plan, roots: tuple[str, ...]) -> list[str]:
    python = [sys.executable, "-I", "-S", "-B", "-c", _runner_source()]
    if plan.layer == "exec":
        return python
    return [*_bwrap_argv(plan, roots), "--", *python]


def _bwrap_argv(plan: _Plan, roots: tuple[str, ...]) -> list[str]:
    """Read-only host; an empty tmpfs over what the call must not see (/tmp, /run, what
    hides Python from the sandbox uid, and ``roots``: the folders of all runs); back,
    read-only, what it needs from under them (Python); then the run's folder, writable.
    Deeper mounts come later: a Python path inside a run root is shown, a run root inside
    a Python path hidden.

    No ``--chdir``: bubblewrap enters it as root without capabilities, which a folder the
    run was given refuses (its owner's, the run's group, mode 2770: not root's). The
    runner enters the folder once it is the call's uid."""
    host = _host(probe=True)
    assert host.bwrap is not None
    argv = [host.bwrap, *host.bwrap_flags]
    if not plan.policy.network:
        argv.append("--unshare-net")
    argv += _base_mounts(plan.quota)
    runs = [r for r in roots if os.path.isdir(r)]  # (a root not made yet: nothing in it)
    masks = sorted({*_masks(), *_closed_above(plan.workdir, ("/tmp", *runs))})
    shows = _binds_under(["/tmp", *masks, *runs], plan.policy.network)
    mounts = [(p, 0, "--tmpfs") for p in masks] + [(p, 1, "--ro-bind") for p in shows]
    mounts += [(p, 2, "--tmpfs") for p in runs]  # (a run root that is a Python path: hidden all the same)
    done = ["/tmp"]
    for path, _, how in sorted(mounts, key=lambda m: (m[0].count("/"), m[1])):
        argv += [*_parents(path, done), how, *([path, path] if how == "--ro-bind" else [path])]
        done.append(path)
    return [*argv, *_parents(plan.workdir, done), "--bind", plan.workdir, plan.workdir]


def _base_mounts(quota: int) -> list[str]:
    """bwrap's private /tmp is memory: at most the run's disk quota, where bwrap has --size."""
    mounts = list(_BASE_MOUNTS)
    if quota and _bwrap_sizes():
        at = mounts.index("--tmpfs")
        mounts[at:at] = ["--size", str(quota)]
    return mounts


@lru_cache(maxsize=1)
def _bwrap_sizes() -> bool:
    """Does this bubblewrap know ``--size`` (0.7 and later)?"""
    import subprocess

    binary = _host(probe=True).bwrap
    if binary is None:
        return False
    proc = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=10, check=False)
    return "--size" in proc.stdout + proc.stderr


def _masks() -> list[str]:
    """/run (daemon sockets) and what hides Python from the sandbox uid; parents first."""
    masks = set(_python_masks())
    if os.path.isdir("/run") and not os.path.islink("/run"):
        masks.add("/run")
    return sorted(masks, key=lambda p: (p.count("/"), p))


@lru_cache(maxsize=256)
def _closed_above(workdir: str, hidden: tuple[str, ...]) -> tuple[str, ...]:
    """The outermost folder on the way to the run's folder that the call's uid may not
    search (a 0750 home holding an allowed root): hidden by a tmpfs, the way down made
    again searchable, as for Python. What a tmpfs hides already (a run root) needs none."""
    for folder in _ancestors(os.path.dirname(workdir)):
        if any(_inside(folder, h) for h in hidden):
            return ()
        with contextlib.suppress(OSError):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return (folder,)
    return ()


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
        home = os.path.realpath(_home())
        return frozenset({home} if home != "/" and os.path.isdir(home) else set())
    masks = set()
    for path in _python_paths():
        blocking = [a for a in _ancestors(path) if not os.stat(a).st_mode & stat.S_IXOTH]
        if blocking:
            masks.add(blocking[0])
    return frozenset(masks)


def _home() -> str:
    """The worker user's home (a uid without a passwd entry, as in some containers: $HOME)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir or "/"
    except KeyError:
        return os.environ.get("HOME") or "/"


def _binds_under(masks: list[str], network: bool) -> list[str]:
    """Python paths (and DNS config when the network is on) under a mask or a run root."""
    wanted = list(_python_paths())
    if network and os.path.exists("/etc/resolv.conf"):
        wanted.append(os.path.realpath("/etc/resolv.conf"))
    return [p for p in wanted if any(_inside(p, m) for m in masks)]
