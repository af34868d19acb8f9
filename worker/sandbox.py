"""Run one tool call in a sandbox: least rights, bounded resources, killed as a whole.

Three layers; ``docs/sandbox.md`` says what each stops and what it does not.

- ``fork`` (the default for ``@tool`` functions; a fork + ~1.5 ms CPU): a fresh child
  per call in its own session; cwd = the run's folder; environment reduced to an
  allowlist; every inherited descriptor but the result pipe pointed at /dev/null;
  rlimits (CPU soft < hard, address space, file size, open files, processes);
  ``no_new_privs``; and when the worker is root, a uid of its own
  (``UID_BASE + pid``) in the run's group (the folder is ``root:<gid> 2770``), so
  RLIMIT_NPROC bounds it and ``kill(-1)`` as that uid ends exactly its processes.
- ``exec``: strict calls without bubblewrap: the same, but the tool runs in a fresh
  interpreter (no copy of the worker's memory), which drops to the call's uid
  after importing the tool's module.
- ``bwrap``: that interpreter inside bubblewrap: read-only root, the run folder the
  only writable path, private /tmp and /run, other runs hidden, no network (unless
  the policy allows it), its own pid namespace, dead with the worker.

``TOOLOOP_SANDBOX``: ``auto`` (strict tools in bwrap when it works here, the rest
forked), ``bwrap`` (every call in bwrap; calls are refused if it does not work),
``basic`` (never bwrap). Whatever the layer, the call's process tree is killed at
the deadline or when ``on_tick`` says the run is over.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import inspect
import json
import logging
import os
import pickle
import pwd
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from orchestrator.models import SandboxPolicy

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "basic")
TICK_S = 0.25  # heartbeat / abort check while a call runs
EXIT_GRACE_S = 1.0  # a call that reported may take this long to exit before it is killed
SWEEP_S = 1.0  # bound on killing and reaping what a call left behind
RESULT_FD = 3  # where the call writes its framed JSON result
REQUEST_FD = 4  # where a spare process waits for its call (see _Spare)
MAX_RESULT_BYTES = 16 << 20
UID_BASE = 0x7000_0000  # per-call uids: UID_BASE + pid (pid_max <= 2**22)
UID_SPAN = 1 << 22
GID_BASE = 0x7100_0000  # per-run groups: GID_BASE + 1 .. GID_BASE + GID_SPAN
GID_SPAN = 1 << 24
GID_COUNTER = "/var/lib/tooloop/gid-counter"  # host-wide, so runs of all deployments differ
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_PASSTHROUGH = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
ALLOWED_COMMANDS_ENV = "TOOLOOP_ALLOWED_COMMANDS"  # read by the shell built-in
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
# Python ignores SIGPIPE and SIGXFSZ so that writes fail with an error: kept that way.
_KEEP = {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}
_RESET_SIGNALS = [s for s in signal.Signals if s not in _KEEP]


@dataclass
class CallOutcome:
    ok: bool
    output: Any = None
    error: str | None = None  # "<type>: <message>", fed back to the model
    duration_ms: float = 0.0


@dataclass
class SandboxContext:
    workdir: str
    timeout_s: float
    policy: SandboxPolicy
    on_tick: Callable[[], bool] = lambda: True  # False: stop the call now (abort)
    strict: bool = False  # the strongest layer available (built-ins, @tool(sandbox="strict"))
    mode: str | None = None  # auto | bwrap | basic; None: TOOLOOP_SANDBOX
    sandbox_root: str | None = None  # parent of all run folders; None: TOOLOOP_SANDBOX_ROOT
    # True: return as soon as the result is in; reaping (and forking the next call's
    # process) waits for settle(). False: nothing of the call survives run_call.
    defer_cleanup: bool = False


class SandboxError(Exception):
    """The call cannot be run as asked (refused before any tool code runs)."""


def jsonable(value: Any) -> Any:
    """Outputs are JSON values; anything else becomes its ``str``."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


# -- what this host offers ---------------------------------------------------------
@dataclass(frozen=True)
class Host:
    root: bool  # the worker runs as root: per-call uids, RLIMIT_NPROC
    proc_children: bool  # /proc/<pid>/task/<tid>/children: orphans can be found and reaped
    bwrap: str | None = None  # path of a bubblewrap that works here
    bwrap_flags: tuple[str, ...] = ()
    bwrap_error: str = ""


def layers(mode: str | None = None) -> dict[str, bool]:
    """Which layers are active on this host (published for ``tooloop doctor``)."""
    host = _host(probe=_mode(mode) != "basic")
    bwrap = _bwrap_on(mode)
    _warn_once(mode)
    return {
        "fork": True,
        "rlimits": True,
        "env_allowlist": True,
        "fds_closed": True,
        "no_new_privs": True,
        "setuid": host.root,
        "nproc": host.root,
        "subreaper": host.proc_children,
        "bwrap": bwrap,
        "netns": bwrap,
        "pidns": bwrap,
        "mountns": bwrap,
    }


def _mode(mode: str | None) -> str:
    if mode is None:
        from orchestrator.settings import get_settings

        mode = get_settings().sandbox
    return mode.strip().lower()


def _bwrap_on(mode: str | None) -> bool:
    return _mode(mode) in ("auto", "bwrap") and _host(probe=True).bwrap is not None


@lru_cache(maxsize=2)
def _host(probe: bool) -> Host:
    """Probed once per process (a forked pool child inherits its parent's answer)."""
    root = os.geteuid() == 0
    children = os.path.exists(f"/proc/self/task/{os.getpid()}/children")
    if not probe:
        return Host(root, children, bwrap_error="not probed: TOOLOOP_SANDBOX=basic")
    binary, flags, error = _probe_bwrap(root)
    return Host(root, children, binary, flags, error)


def _probe_bwrap(root: bool) -> tuple[str | None, tuple[str, ...], str]:
    binary = shutil.which("bwrap", path=SYSTEM_PATH) or shutil.which("bwrap")
    if binary is None:
        return None, (), "bubblewrap is not installed (apt-get install -y bubblewrap)"
    error = ""
    for flags in _bwrap_flag_sets(root):
        argv = [binary, *flags, "--unshare-net", *_BASE_MOUNTS, "--", *_probe_command(root)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, (), f"bwrap probe failed: {exc}"
        if proc.returncode == 0:
            return binary, flags, ""
        error = (proc.stderr or proc.stdout).strip()[-300:] or f"exit {proc.returncode}"
    return None, (), f"bwrap does not work here: {error}"


def _bwrap_flag_sets(root: bool) -> list[tuple[str, ...]]:
    common = ("--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
              "--unshare-uts", "--unshare-cgroup-try", "--hostname", "tooloop")  # fmt: skip
    if root:
        # Privileged bwrap (it must read paths a sandbox uid cannot, e.g. /root/.pyenv);
        # the runner keeps only what it needs to drop to the call's uid, then drops it.
        caps = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID")
        return [common + caps]
    return [(*common, "--unshare-user", "--disable-userns"), (*common, "--unshare-user")]


_BASE_MOUNTS = ("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--perms", "1777", "--tmpfs", "/tmp")  # fmt: skip


def _probe_command(root: bool) -> list[str]:
    if not root:
        return ["/bin/sh", "-c", "true"]
    uid = UID_BASE + os.getpid()  # nobody else holds this uid while we live
    drop = f"import os; os.setgroups([{uid}]); os.setresgid(*[{uid}]*3); os.setresuid(*[{uid}]*3)"
    return [sys.executable, "-I", "-S", "-c", drop]


_warned: set[str] = set()


def _warn_once(mode: str | None) -> None:
    """The loud warnings of worker start: a weaker sandbox than the operator may think."""
    mode = _mode(mode)
    if mode in _warned:
        return
    _warned.add(mode)
    host = _host(probe=mode != "basic")
    lines = []
    if mode not in MODES:
        lines.append(f"TOOLOOP_SANDBOX={mode!r} is not one of {MODES}: every tool call is refused.")
    elif mode == "basic":
        lines.append("TOOLOOP_SANDBOX=basic: bubblewrap is off; tool calls get the always-layer only.")
    elif host.bwrap is None:
        refused = "every tool call is refused" if mode == "bwrap" else "strict tools run without it"
        lines.append(f"bubblewrap unavailable ({host.bwrap_error}); {refused}.")
    if lines:
        lines.append("No network, mount or pid isolation for tool calls (see docs/sandbox.md).")
    if not host.root:
        lines.append("The worker is not root: tool calls run as the worker's own user (its files, "
                     "its other processes' /proc) and RLIMIT_NPROC is not applied (fork bombs).")  # fmt: skip
    hidden = [p for p in _python_paths() if not _reachable_by_others(p)]
    if host.root and hidden:
        lines.append(f"Python paths unreadable by sandbox uids ({', '.join(hidden[:3])}): "
                     "outside bwrap, tools cannot import modules lazily or start Python.")  # fmt: skip
    if lines:
        bar = "!" * 78
        log.warning("\n%s\n  TOOL SANDBOX WEAKER THAN IT COULD BE\n  %s\n%s", bar, "\n  ".join(lines), bar)


# -- run folders -------------------------------------------------------------------
def prepare_workdir(path: str, sandbox_root: str | None = None) -> str:
    """Create the run's folder; when root, hand it to the run's group (``root:<gid> 2770``).
    Never raises: a folder that cannot be prepared fails the call (``run_call``), not the task."""
    try:
        _prepare(path, _sandbox_root(sandbox_root))
    except (OSError, SandboxError) as exc:
        log.warning("sandbox: cannot prepare %s: %s", path, exc)
    return path


def _prepare(path: str, root: str) -> int | None:
    """Create the folder; the run's group when root (else None)."""
    known = _prepared.get(path)
    if known is not None and _still_prepared(*known):  # the calls of a run: one lstat
        return known[1]
    _check_root(root)
    os.makedirs(path, exist_ok=True)
    real = os.path.realpath(path)
    gid = _run_gid(real, root) if os.geteuid() == 0 else None
    if gid is not None:
        _prepared[path] = (real, gid)
    return gid


_prepared: dict[str, tuple[str, int]] = {}  # run folder -> (real path, the run's gid)


def _still_prepared(real: str, gid: int) -> bool:
    try:
        st = os.lstat(real)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_gid == gid and stat.S_IMODE(st.st_mode) == 0o2770


_checked_roots: set[str] = set()


def _check_root(root: str) -> None:
    """The folder of all runs: a real folder, and (when root) root's own. A folder in
    /tmp made by someone else would let them swap run folders for symlinks."""
    if root in _checked_roots:
        return
    os.makedirs(root, mode=0o711, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"sandbox root {root} is not a folder (a symlink?)")
    if os.geteuid() == 0 and st.st_uid != 0:
        raise SandboxError(f"sandbox root {root} belongs to uid {st.st_uid}, not root")
    mode = stat.S_IMODE(st.st_mode)
    if os.geteuid() == 0 and mode & 0o044 and not mode & 0o002:  # (never /tmp itself)
        os.chmod(root, (mode & ~0o044) | 0o011)  # calls may cross it, not list other runs
    _checked_roots.add(root)


def _sandbox_root(given: str | None) -> str:
    if given is not None:
        return given
    from orchestrator.settings import get_settings

    return get_settings().sandbox_root


def _is_run_gid(gid: int) -> bool:
    return GID_BASE < gid <= GID_BASE + GID_SPAN


def _run_gid(path: str, root: str) -> int:
    """The run's group, allocated the first time a call runs in this folder."""
    st = os.lstat(path)
    if not (_is_run_gid(st.st_gid) and stat.S_IMODE(st.st_mode) == 0o2770):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two first calls of one run: one group
            st = os.fstat(fd)
            if not _is_run_gid(st.st_gid):
                _adopt_tree(fd, _next_gid(root))
            os.fchmod(fd, 0o2770)
            st = os.fstat(fd)
        finally:
            os.close(fd)
    _make_reachable(path)
    return st.st_gid


def _next_gid(root: str) -> int:
    for counter in (GID_COUNTER, os.path.join(root, ".gid-counter")):
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(counter), mode=0o700, exist_ok=True)
            fd = os.open(counter, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                last = int(os.pread(fd, 32, 0).strip() or 0)
                n = last % GID_SPAN + 1  # wraps after 16.7 M runs: see docs/sandbox.md
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{n}\n".encode(), 0)
                return GID_BASE + n
            finally:
                os.close(fd)
    raise SandboxError(f"cannot allocate a group for run folders ({GID_COUNTER} not writable)")


def _adopt_tree(dir_fd: int, gid: int) -> None:
    """Give a folder, and what is already in it, to the run's group.

    Through descriptors opened with O_NOFOLLOW, so a symlink swapped in cannot
    redirect a chown/chmod outside the folder; hard-linked files are skipped (a
    link to a file elsewhere would be handed over with it).
    """
    for _, dirs, files, fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in dirs + files:
            _adopt_entry(fd, name, gid)
    os.fchown(dir_fd, -1, gid)


def _adopt_entry(dir_fd: int, name: str, gid: int) -> None:
    st = os.lstat(name, dir_fd=dir_fd)
    if stat.S_ISLNK(st.st_mode):
        os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
        return
    is_dir = stat.S_ISDIR(st.st_mode)
    if not (is_dir or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1)):
        return
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return  # changed under us: leave it
    try:
        os.fchown(fd, -1, gid)
        extra = 0o2070 if is_dir else 0o060 | (0o010 if st.st_mode & 0o100 else 0)
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | extra)
    finally:
        os.close(fd)


_reachable: set[str] = set()


def _make_reachable(path: str) -> None:
    """Sandbox uids must be able to walk to the run folder: add search (o+x, not read) on
    its root-owned ancestors; warn about the others."""
    parent = os.path.dirname(path)
    if parent in _reachable:
        return
    for ancestor in _ancestors(parent):
        st = os.stat(ancestor)
        if st.st_mode & stat.S_IXOTH:
            continue
        if st.st_uid == 0:
            os.chmod(ancestor, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
            log.warning("sandbox: added o+x to %s so sandbox uids can reach %s", ancestor, path)
        else:
            log.warning("sandbox: %s is not searchable by sandbox uids: %s is unreachable", ancestor, path)
    _reachable.add(parent)


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``['/', '/a', '/a/b', '/a/b/c']``."""
    out = [path]
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def _reachable_by_others(path: str) -> bool:
    try:
        return all(os.stat(a).st_mode & stat.S_IXOTH for a in _ancestors(path))
    except OSError:
        return False


# -- planning a call (in the worker, before the fork) --------------------------------
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
    for code in [*_python_paths(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]:
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


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@lru_cache(maxsize=1)
def _python_paths() -> tuple[str, ...]:
    """Where this interpreter and its modules live, outermost only."""
    candidates = {os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
                  sys.prefix, sys.base_prefix, sys.exec_prefix, *_module_path()}  # fmt: skip
    real = {os.path.realpath(p) for p in candidates if p and os.path.exists(p)}
    return tuple(sorted(p for p in real if not any(q != p and _inside(p, q) for q in real)))


@lru_cache(maxsize=1)
def _module_path() -> tuple[str, ...]:
    """The worker's ``sys.path`` as absolute paths ('' is the worker's cwd, not the run's)."""
    return tuple(os.path.abspath(p or os.getcwd()) for p in sys.path if os.path.exists(p or "."))


# -- running a call ------------------------------------------------------------------
def run_call(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext) -> CallOutcome:
    _run_pending()
    started = time.perf_counter()
    try:
        plan = _plan(fn, kwargs, ctx)
    except (SandboxError, OSError) as exc:
        outcome = CallOutcome(False, error=f"SandboxError: {exc}")
    else:
        outcome = _Call(plan, ctx).run(fn, kwargs)
    outcome.duration_ms = round((time.perf_counter() - started) * 1000, 3)
    return outcome


class _Call:
    """The worker's side of one call: fork, watch, kill what is left, decode."""

    def __init__(self, plan: _Plan, ctx: SandboxContext) -> None:
        self.plan, self.ctx = plan, ctx
        self.root = os.geteuid() == 0
        self.pid = 0
        self.exited = False
        self.status: int | None = None  # set when reaped while watching (no pidfd)
        self.clean = False  # ended the usual way: only zombies may be left to reap

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> CallOutcome:
        _become_subreaper()
        spare = _take_spare(fn, kwargs, self.plan)
        before = set() if self.root else set(_children()) - {spare.pid if spare else 0}
        if spare is not None:
            self.pid, read_fd = spare.pid, spare.result_fd
        else:
            started = self._fork(fn, kwargs)
            if isinstance(started, CallOutcome):
                return started
            read_fd = started
        reader, stopped, pidfd, status = _Reader(), "interrupted", None, 0
        try:
            pidfd = _pidfd(self.pid)
            stopped = self._watch(read_fd, pidfd, reader)
        finally:
            if self.ctx.defer_cleanup and stopped is None and reader.complete and not self.exited:
                # The hot path: the result is in; its process ends off the critical path.
                _pending.append(lambda: self._cleanup(read_fd, pidfd, reader, before, None))
            else:
                status = self._cleanup(read_fd, pidfd, reader, before, stopped)
        if stopped:
            return CallOutcome(False, error=stopped)
        return _decode(reader, status, self.plan.layer)

    def _fork(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> int | CallOutcome:
        """Fork the call's process now (no spare): its result pipe, or why it failed."""
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        facts = _facts(self.plan)
        try:
            self.pid = os.fork()
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            return CallOutcome(False, error=f"SandboxError: cannot start the call's process: {exc}")
        if self.pid == 0:  # child: never returns
            _child(self.plan, facts, fn, kwargs, write_fd, parent)
        os.close(write_fd)
        return read_fd

    def _cleanup(self, read_fd: int, pidfd: int | None, reader: _Reader, before: set[int],
                 stopped: str | None) -> int:  # fmt: skip
        """Kill and reap the call's processes; whatever happened, nothing of it survives."""
        try:
            if stopped is None and not self.exited:
                self._await_exit(pidfd)
            status = self._finish(reader, clean_stop=stopped is None)
        finally:
            if pidfd is not None:
                os.close(pidfd)
            os.close(read_fd)
            if not (self.clean and _reap_sandbox_zombies()):
                _sweep(self._ours(before))
        return status

    def _await_exit(self, pidfd: int | None) -> None:
        """A call that reported kills its own uid and exits: give it EXIT_GRACE_S."""
        if pidfd is not None:
            self.exited = bool(select.select([pidfd], [], [], EXIT_GRACE_S)[0])
            return
        deadline = time.monotonic() + EXIT_GRACE_S
        while not self._reaped() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.exited = self.status is not None

    def _watch(self, read_fd: int, pidfd: int | None, reader: _Reader) -> str | None:
        """Until the process exits (or reported and lingers): None, else why it is stopped."""
        os.set_blocking(read_fd, False)
        deadline = time.monotonic() + self.ctx.timeout_s
        next_tick = time.monotonic() + TICK_S
        watched = [read_fd] if pidfd is None else [read_fd, pidfd]
        while not self.exited:
            now = time.monotonic()
            if reader.complete:
                if self.plan.layer == "fork":
                    return None  # the result is in: its exit is awaited off the hot path
                deadline = min(deadline, reader.complete_at + EXIT_GRACE_S)  # let it exit
                if now >= deadline:
                    return None
            elif now >= deadline:
                return f"Timeout: tool call exceeded {self.ctx.timeout_s:g}s"
            if now >= next_tick:
                next_tick = now + TICK_S
                if not self._still_wanted():
                    return "Aborted: the run ended while the tool ran"
            wait = max(0.0, min(deadline, next_tick) - now)
            ready, _, _ = select.select(watched, [], [], wait if pidfd is not None else min(wait, 0.01))
            if read_fd in ready and not reader.pull(read_fd):
                watched.remove(read_fd)  # EOF; the process may still run
            if pidfd in ready or (pidfd is None and self._reaped()):
                self.exited = True
                reader.drain(read_fd)
            if reader.overflow:
                return f"OutputTooLarge: the tool's output exceeds {MAX_RESULT_BYTES >> 20} MiB"
        return None

    def _reaped(self) -> bool:
        """Without a pidfd: has the call's process exited? (reaps it)"""
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = status
        return bool(pid)

    def _still_wanted(self) -> bool:
        """``on_tick`` (the lease heartbeat); a failing one (Redis away) does not stop the call."""
        try:
            return self.ctx.on_tick()
        except Exception:
            log.warning("sandbox: on_tick failed; the call goes on", exc_info=True)
            return True

    def _finish(self, reader: _Reader, clean_stop: bool) -> int:
        """Kill the call's processes (all of them) and reap the call's own process."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # its session, whatever its uid
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        status = self.status
        if status is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                status = 0
        reported = clean_stop and reader.complete and os.WIFEXITED(status) and status == 0
        if self.root and not reported:  # it did not get to kill(-1) its own uid: we do
            _kill_uid(UID_BASE + self.pid)
        # The hot path: a forked call that reported, then killed all of its uid itself.
        self.clean = reported and self.root and self.plan.layer == "fork"
        return status

    def _ours(self, before: set[int]) -> Callable[[int], bool]:
        """Which children of this process (as subreaper) belong to sandboxed calls: a
        sandbox uid's, or bwrap's own (its namespace init, root, is orphaned when bwrap
        exits: left alone it stays a zombie of this process)."""
        if self.root:
            return lambda pid: _is_sandbox_process(*_proc_identity(pid))
        return lambda pid: pid not in before


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits; None where seccomp refuses
    pidfd_open (older Docker profiles): the watch then polls waitpid every 10 ms."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class _Reader:
    """The framed result: 8-byte big-endian length, then that much JSON."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.complete_at = 0.0

    @property
    def size(self) -> int | None:
        return int.from_bytes(self.buf[:8], "big") if len(self.buf) >= 8 else None

    @property
    def complete(self) -> bool:
        size = self.size
        return size is not None and len(self.buf) >= 8 + size

    @property
    def overflow(self) -> bool:
        return (self.size or 0) > MAX_RESULT_BYTES or len(self.buf) > MAX_RESULT_BYTES + 8

    def pull(self, fd: int) -> bool:
        """One read; False on EOF."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        self.buf += chunk
        if self.complete and not self.complete_at:
            self.complete_at = time.monotonic()
        return bool(chunk)

    def drain(self, fd: int) -> None:
        while not self.overflow and self.pull(fd):
            if not select.select([fd], [], [], 0)[0]:
                return

    def payload(self) -> dict[str, Any] | None:
        if not self.complete:
            return None
        return json.loads(bytes(self.buf[8 : 8 + (self.size or 0)]))


def _decode(reader: _Reader, status: int, layer: str) -> CallOutcome:
    try:
        payload = reader.payload()
    except ValueError:  # a tool that wrote on the result pipe itself
        return CallOutcome(False, error="Crashed: the tool process sent an unreadable result")
    if payload is not None:
        if "ok" in payload:
            return CallOutcome(True, output=payload["ok"])
        return CallOutcome(False, error=payload["error"])
    signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
    if layer == "bwrap" and code > 128:  # bwrap exits 128 + the signal that killed the tool
        signum, code = code - 128, 0
    if signum:
        name = signal.Signals(signum).name if signum in set(signal.Signals) else str(signum)
        return CallOutcome(False, error=f"Killed: tool process died on {name} (a limit?)")
    return CallOutcome(False, error=f"Crashed: tool process exited {code}")


# -- killing what a call leaves behind -----------------------------------------------
def _become_subreaper() -> None:
    """Orphans of a call (``setsid`` + double fork) are re-parented to us, not to init:
    we can find, kill and reap them. Not inherited over fork: once per process."""
    if _subreaper_pid[0] != os.getpid():
        _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper_pid[0] = os.getpid()


_subreaper_pid = [0]


@lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _children() -> list[int]:
    """Children of this process: the calls' processes, and orphans re-parented to it
    (the kernel hands those to the main thread while it lives; calls fork from it)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _proc_uid(pid: int) -> int | None:
    return _proc_identity(pid)[1]


def _proc_identity(pid: int) -> tuple[str, int | None]:
    """(command name, real uid) of a process, from /proc/<pid>/status."""
    name, uid = "", None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Name:"):
                    name = line.split(None, 1)[1].strip()
                elif line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    return name, uid


def _is_sandbox_process(name: str, uid: int | None) -> bool:
    return name == "bwrap" or (uid is not None and UID_BASE <= uid < UID_BASE + UID_SPAN)


def _sweep(ours: Callable[[int], bool]) -> None:
    """Kill and reap the call's orphans, round after round (killing one re-parents its
    children to us), for at most SWEEP_S."""
    deadline = time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        kids = [pid for pid in _children() if ours(pid)]
        if not kids:
            return
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.001)
    log.warning("sandbox: orphans of a tool call still alive after %.1fs", SWEEP_S)


def _reap_sandbox_zombies() -> bool:
    """Reap exited children of sandbox uids (orphans of calls, re-parented to us) without
    reading /proc: ``waitid(WNOWAIT)`` shows an exited child's uid before it is reaped.
    True when no child is left; False if some still runs (maybe a call's, killed but not
    dead yet) or is not a sandbox uid's: then sweep the slow way."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True  # the usual case in a pool process: no child at all
        if info is None or not UID_BASE <= info.si_uid < UID_BASE + UID_SPAN:
            return False
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _kill_uid(uid: int) -> None:
    """``kill(-1)`` as ``uid``: every process of that uid, atomically (a fork bomb cannot
    outrun it), escaped sessions included. Never as root: that would kill the host."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            if uid != 0 and os.getresuid() == (uid, uid, uid):
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


# -- the call's process ---------------------------------------------------------------
@dataclass
class _Facts:
    """What the call's process needs to know about itself, found before the fork: in
    the child every page Python touches is a copy-on-write fault (the hot path)."""

    fds: list[int]  # the worker's open descriptors
    handlers: list[signal.Signals]  # signals with a handler of the worker's
    env_drop: list[str]  # environment variables outside the allowlist
    limits: list[tuple[int, tuple[int, int]]]


def _facts(plan: _Plan) -> _Facts:
    fork = plan.layer == "fork"
    return _Facts(
        fds=[int(n) for n in os.listdir("/proc/self/fd")] if fork else [],
        handlers=_handlers(os.getpid()),
        env_drop=[k for k in _worker_env_keys(os.getpid()) if k not in plan.env] if fork else [],
        limits=_limits(plan.policy, nproc=os.geteuid() == 0, fork=fork),
    )


@lru_cache(maxsize=4)
def _worker_env_keys(pid: int) -> tuple[str, ...]:
    """The worker's environment does not change while it serves: listed once per process."""
    return tuple(os.environ)


@lru_cache(maxsize=4)
def _handlers(pid: int) -> list[signal.Signals]:
    """Signals this process handles (Celery's, set at start): looked up once per process."""
    return [s for s in _RESET_SIGNALS if signal.getsignal(s) not in (signal.SIG_DFL, None)]


def _child(plan: _Plan, facts: _Facts, fn: Callable[..., Any], kwargs: dict[str, Any],
           write_fd: int, parent: int) -> NoReturn:  # fmt: skip
    code = 1
    try:
        os.dup2(write_fd, RESULT_FD)  # first: errors below are reported through it
        _isolate(plan, facts)
        if plan.layer == "fork":
            _confine(plan, facts, parent, drop=plan.gid is not None)
            code = _serve(plan, fn, kwargs)
        else:
            _exec_runner(plan, facts, parent)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            _report({"error": f"SandboxError: {type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


# -- spare processes: the fork, off the hot path -----------------------------------
# A forked call pays for fork(), exit and reaping of a ~50 MB worker (~2.5 ms here).
# So each pool process keeps one spare: forked (and detached: own session, no worker
# descriptors) after the previous call was recorded, it waits for exactly one call,
# then confines itself as a fresh fork would. One process per call, as before.
@dataclass
class _Spare:
    pid: int
    request_fd: int  # the worker writes the call here (pickle: worker -> its own fork)
    result_fd: int  # the call's framed JSON result comes back here

    def send(self, request: tuple[Any, ...]) -> None:
        data = pickle.dumps(request)
        view = memoryview(len(data).to_bytes(8, "big") + data)
        try:
            while view:
                view = view[os.write(self.request_fd, view) :]
        finally:
            os.close(self.request_fd)

    def discard(self) -> None:
        for fd in (self.request_fd, self.result_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


_spares: dict[int, _Spare] = {}  # pool process pid -> its spare
_spare_wanted: set[int] = set()  # pool processes that run forked calls
_pending: list[Callable[[], Any]] = []  # cleanups of calls whose result is in


def settle() -> None:
    """After a call's result is recorded: reap what the call left, and fork the next
    call's process now rather than when that call arrives."""
    _run_pending()
    if os.getpid() in _spare_wanted and os.getpid() not in _spares:
        try:
            _spares[os.getpid()] = _spawn_spare()
        except OSError:
            log.warning("sandbox: cannot fork a spare process; calls fork on demand", exc_info=True)


def _run_pending() -> None:
    while _pending:
        cleanup = _pending.pop(0)
        try:
            cleanup()
        except Exception:
            log.exception("sandbox: cleaning up after a call failed")


def _take_spare(fn: Callable[..., Any], kwargs: dict[str, Any], plan: _Plan) -> _Spare | None:
    """This process's spare, with the call sent to it; None: fork on demand."""
    if plan.layer != "fork":
        return None
    _spare_wanted.add(os.getpid())
    name = _registered_name(fn)
    spare = _spares.pop(os.getpid(), None)
    if spare is None or name is None:
        if spare is not None:
            _spares[os.getpid()] = spare
        return None
    env_drop = [k for k in _worker_env_keys(os.getpid()) if k not in plan.env]
    limits = _limits(plan.policy, nproc=os.geteuid() == 0, fork=True)
    try:
        spare.send((plan, env_drop, limits, name, kwargs, os.getpid()))
    except OSError:  # it died meanwhile (killed from outside?)
        spare.discard()
        return None
    return spare


def _registered_name(fn: Callable[..., Any]) -> str | None:
    from worker.registry import REGISTRY

    return next((name for name, t in REGISTRY.items() if t.fn is fn), None)


def _spawn_spare() -> _Spare:
    facts = _Facts(fds=[int(n) for n in os.listdir("/proc/self/fd")],
                   handlers=_handlers(os.getpid()), env_drop=[], limits=[])  # fmt: skip
    request_r, request_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(request_w)
        os.close(result_r)
        _spare_main(facts, result_w, request_r)
    os.close(request_r)
    os.close(result_w)
    return _Spare(pid, request_w, result_r)


def _spare_main(facts: _Facts, result_w: int, request_r: int) -> NoReturn:
    code = 1
    try:
        high_w, high_r = fcntl.fcntl(result_w, fcntl.F_DUPFD, 10), fcntl.fcntl(request_r, fcntl.F_DUPFD, 10)
        os.dup2(high_w, RESULT_FD)  # first: errors below are reported through it
        os.dup2(high_r, REQUEST_FD)
        for fd in {high_w, high_r, result_w, request_r} - {RESULT_FD, REQUEST_FD}:
            os.close(fd)
        _detach(facts, forked=True, keep=(REQUEST_FD,))
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # an idle spare dies with its worker
        request = _read_request()
        if request is None:  # the worker went away (or changed its mind)
            code = 0
            return
        plan, env_drop, limits, name, kwargs, parent = request
        from worker.registry import REGISTRY

        _enter(plan, env_drop)
        _confine(plan, _Facts([], [], env_drop, limits), parent, drop=plan.gid is not None)
        code = _serve(plan, REGISTRY[name].fn, kwargs)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            _report({"error": f"SandboxError: {type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


def _read_request() -> tuple[Any, ...] | None:
    data = b""
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        chunk = os.read(REQUEST_FD, 1 << 16)
        if not chunk:
            return None
        data += chunk
    os.close(REQUEST_FD)
    return pickle.loads(data[8:])  # from the worker itself, through its own pipe


def _isolate(plan: _Plan, facts: _Facts) -> None:
    """Session, signals, descriptors, folder, environment: nothing of the worker's."""
    _detach(facts, forked=plan.layer == "fork")
    _enter(plan, facts.env_drop)


def _detach(facts: _Facts, forked: bool, keep: tuple[int, ...] = ()) -> None:
    """Its own session, default signal handlers, none of the worker's descriptors."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in facts.handlers:  # none of the worker's handlers (Celery's SIGTERM...)
        signal.signal(sig, signal.SIG_DFL)
    _stdio_to_devnull(facts.fds if forked else None, keep)


def _enter(plan: _Plan, env_drop: list[str]) -> None:
    """The run's folder and the allowlisted environment."""
    os.chdir(plan.workdir)
    os.umask(0o007)  # files stay the run's group's
    if plan.layer == "fork":  # (not os.environ.clear(): quadratic, ~1 ms here)
        for key in env_drop:
            del os.environ[key]
        os.environ.update(plan.env)


def _confine(plan: _Plan, facts: _Facts, parent: int, drop: bool) -> None:
    """Limits, no_new_privs, the call's uid, death with the worker."""
    for which, limit in facts.limits:
        resource.setrlimit(which, limit)
    prctl = _libc().prctl
    prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries gain nothing
    # Its /proc/self/environ still shows the worker's environment block (a forked copy):
    # not dumpable, /proc/self/* belongs to root. (Setting a new uid does this too.)
    prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if drop:
        assert plan.gid is not None
        _drop(UID_BASE + os.getpid(), plan.gid)
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the drop, which clears it
    if os.getppid() != parent:
        raise SandboxError("the worker died")


def _stdio_to_devnull(inherited: list[int] | None, keep: tuple[int, ...] = ()) -> None:
    """0-2 -> /dev/null; every other inherited descriptor (Redis sockets, the broker
    connection, log files) is closed (``inherited`` None: an exec follows), or, in the
    forked interpreter whose objects still hold those numbers, pointed at /dev/null so
    that no number is reused under them."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    if inherited is None:
        os.closerange(RESULT_FD + 1, 1 << 20)
        return
    for fd in inherited:
        if fd > RESULT_FD and fd != null and fd not in keep:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    if null > RESULT_FD:
        os.close(null)


def _limits(policy: SandboxPolicy, nproc: bool, fork: bool) -> list[tuple[int, tuple[int, int]]]:
    mb = 1024 * 1024
    memory = policy.memory_mb * mb
    if fork:  # the forked worker's own mappings are not the call's to spend
        memory += _address_space()
    wanted = {
        resource.RLIMIT_CPU: (policy.cpu_s, policy.cpu_s + 1),  # SIGXCPU, then SIGKILL
        resource.RLIMIT_AS: (memory, memory),
        resource.RLIMIT_FSIZE: (policy.max_file_mb * mb, policy.max_file_mb * mb),
        resource.RLIMIT_NOFILE: (policy.max_open_files, policy.max_open_files),
        resource.RLIMIT_CORE: (0, 0),  # a core file would hold the worker's memory
    }
    if nproc:  # counted per real uid: meaningful only with a uid of the call's own
        wanted[resource.RLIMIT_NPROC] = (policy.max_processes, policy.max_processes)
    limits = []
    for which, (soft, hard) in wanted.items():
        current_hard = _hard_limit(which)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        limits.append((which, (soft, hard)))
    return limits


@lru_cache(maxsize=16)
def _hard_limit(which: int) -> int:
    return resource.getrlimit(which)[1]


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _drop(uid: int, gid: int) -> None:
    os.setgroups([gid])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SandboxError("could not drop to the call's uid")


def _serve(plan: _Plan, fn: Callable[..., Any], kwargs: dict[str, Any]) -> int:
    try:
        payload = {"ok": jsonable(fn(**kwargs))}
    except BaseException as exc:  # the model sees every failure, whatever its type
        payload = {"error": f"{type(exc).__name__}: {exc}"}
    if plan.gid is not None:
        _kill_own_uid()  # first: when the worker reads the result, nothing else runs
    _report(payload)
    return 0


def _kill_own_uid() -> None:
    """End whatever the call started (setsid'd or not) before reporting the end."""
    uid = os.getuid()
    if uid != 0 and os.geteuid() != 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # all processes of this uid but this one


def _report(payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    if len(data) > MAX_RESULT_BYTES:
        data = json.dumps({"error": f"OutputTooLarge: {len(data)} bytes of output"}).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[os.write(RESULT_FD, view) :]


def _exec_runner(plan: _Plan, facts: _Facts, parent: int) -> NoReturn:
    """Replace this process with the runner; its request arrives on stdin (a memfd).
    The request is written before the limits: this process is still the worker's size."""
    uid = UID_BASE + os.getpid()
    request = {
        "path": [p for p in _module_path() if not _inside(p, plan.workdir)],
        "module": plan.target[0],
        "qualname": plan.target[1],
        "kwargs": plan.kwargs_blob,
        "drop": (uid, plan.gid) if plan.gid is not None else None,
        "parent": parent if plan.layer == "exec" else None,  # outside bwrap: re-arm pdeathsig
    }
    fd = os.memfd_create("tooloop-call", 0)
    os.write(fd, pickle.dumps(request))
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    _confine(plan, facts, parent, drop=False)  # the runner drops, after importing the tool
    os.execve(plan.argv[0], plan.argv, plan.env)


# -- the runner: source shipped to a fresh ``python -I -S -B -c`` ----------------------
# These functions run in the sandbox, not in the worker: standard library only,
# imported inside them, so the sandbox never imports this module (nor pydantic).
def _runner_main() -> None:
    import json  # noqa: F401  (before the drop: the call's uid may not read the stdlib)
    import os
    import pickle
    import sys

    chunks = [os.read(0, 1 << 20)]
    while chunks[-1]:
        chunks.append(os.read(0, 1 << 20))
    request = pickle.loads(b"".join(chunks))
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.path[:] = request["path"]
    code, payload = 1, None
    try:
        fn = _runner_import(request["module"], request["qualname"])
        kwargs = pickle.loads(request["kwargs"])
        if request["drop"]:
            _runner_drop(*request["drop"], request["parent"])
    except BaseException as exc:
        payload = {"error": f"SandboxError: cannot start the tool: {type(exc).__name__}: {exc}"}
    if payload is None:
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


_RUNNER_FUNCTIONS = (_runner_import, _runner_drop, _runner_call, _runner_report, _runner_main)


@lru_cache(maxsize=1)
def _runner_source() -> str:
    parts = [textwrap.dedent(inspect.getsource(f)) for f in _RUNNER_FUNCTIONS]
    return "from __future__ import annotations\n\n" + "\n\n".join(parts) + "\n_runner_main()\n"
