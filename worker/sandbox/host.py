"""What this host offers: root, /proc, a bubblewrap that works (probed once per
process); ``layers`` for ``tooloop doctor``, and the loud warning of worker start."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache

from worker.sandbox.constants import MODES, SYSTEM_PATH
from worker.sandbox.paths import _inside, _python_paths, _reachable_by_others

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Host:
    root: bool  # the worker runs as root: per-call uids, RLIMIT_NPROC
    proc_children: bool  # /proc/<pid>/task/<tid>/children: orphans can be found and reaped
    bwrap: str | None = None  # path of a bubblewrap that works here
    bwrap_flags: tuple[str, ...] = ()
    bwrap_error: str = ""


def layers(mode: str | None = None) -> dict[str, bool]:
    """Which layers are active on this host (published for ``tooloop doctor``)."""
    from worker.sandbox.kernel import status

    host = _host(probe=_mode(mode) != "basic")
    bwrap = _bwrap_on(mode)
    kernel = status()
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
        "landlock": not kernel["landlock"],
        "landlock_net": not kernel["landlock_net"],
        "seccomp": not kernel["seccomp"],
    }


def layer_reasons(mode: str | None = None) -> dict[str, str]:
    """Why each layer that is off is off (``tooloop doctor``, ``/api/health``)."""
    from worker.sandbox.kernel import status

    host = _host(probe=_mode(mode) != "basic")
    reasons = {k: v for k, v in status().items() if v}
    if not _bwrap_on(mode):
        reasons["bwrap"] = host.bwrap_error or f"TOOLOOP_SANDBOX={_mode(mode)}"
    if not host.root:
        reasons["setuid"] = "the worker is not root: calls run as its own user"
    return reasons


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
    # Python under /tmp (a venv made there) is hidden by the private /tmp: bound back, as for calls.
    binds = [a for p in _python_paths() if _inside(p, "/tmp") for a in ("--ro-bind", p, p)]
    for flags in _bwrap_flag_sets(root):
        argv = [binary, *flags, "--unshare-net", *_BASE_MOUNTS, *binds, "--", *_probe_command(root)]
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
    from worker.sandbox.folders import _sandbox_root, next_uid

    uid = next_uid(_sandbox_root(None))  # a call's uid: nobody else holds it
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
    from worker.sandbox.kernel import status

    kernel = {k: v for k, v in status().items() if v}
    if lines:
        lines.append("No mount or pid isolation for tool calls (see docs/sandbox.md).")
    if kernel:
        lines += [f"{k} off: {why}" for k, why in kernel.items()]
        if lines and (mode == "basic" or host.bwrap is None):
            lines.append("Without bwrap and Landlock/seccomp, tool calls may reach the network.")
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
