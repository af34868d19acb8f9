"""The sandbox, attacked the way a hostile model would (issue 5).

Unit level: ``run_call`` in this process, under each layer:
- ``fork``: TOOLOOP_SANDBOX=basic, a default ``@tool`` (the always-layer alone);
- ``exec``: TOOLOOP_SANDBOX=basic, a strict tool (always-layer, fresh interpreter);
- ``bwrap``: TOOLOOP_SANDBOX=bwrap (every call in bubblewrap).
End to end: real workers (one ``auto``, one ``basic``), each with its own key prefix,
driven by the scripted model.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest
import redis

from orchestrator import Client
from orchestrator.models import SandboxPolicy
from orchestrator.settings import Settings, get_settings
from orchestrator.validation import SpecError
from tests import hostile_tools as hostile
from tests.conftest import ROOT, WorkerProcess
from tests.helpers import wait_for
from worker import builtins, sandbox
from worker.registry import REGISTRY, tool
from worker.sandbox import CallOutcome, SandboxContext, layers, run_call, zygote
from worker.sandbox.fork_server import may_renice

BWRAP = layers("auto")["bwrap"]
KERNEL = sandbox.kernel.status()  # why Landlock / its TCP rules / seccomp are off ("" when on)
LANDLOCK, LANDLOCK_NET, SECCOMP = (not KERNEL[k] for k in ("landlock", "landlock_net", "seccomp"))
NO_BWRAP = "bubblewrap does not work on this host: " + sandbox.host._host(probe=True).bwrap_error
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="per-call uids and RLIMIT_NPROC need a root worker")
REDIS = urlparse(os.environ["TOOLOOP_REDIS_URL"])


def runs_root() -> str:
    return os.environ["TOOLOOP_SANDBOX_ROOT"]


def new_run() -> str:
    return os.path.join(runs_root(), f"run-{uuid.uuid4().hex[:10]}")


def marker() -> str:
    """A unique ``sleep`` argument: finds the sleeper in /proc, whatever its pid namespace."""
    return f"{random.randint(500, 900)}.{random.randint(10**8, 10**9)}"


def alive(mark: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if mark.encode() in cmdline:
                pids.append(int(name))
    return pids


def of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with_uid = sandbox.reaper._proc_uid(int(name))
            if with_uid == uid:
                pids.append(int(name))
    return pids


def gone(probe: Callable[[], list[int]], within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class Layer:
    name: str  # fork | exec | bwrap
    mode: str  # TOOLOOP_SANDBOX
    strict: bool
    reuse: bool = False  # fork: the call runs in a process that served the run's previous call

    @property
    def bwrap(self) -> bool:
        return self.name == "bwrap"

    def call(self, fn: Callable[..., Any], run: str | None = None, timeout: float = 30,
             policy: SandboxPolicy | None = None, on_tick: Callable[[], bool] | None = None,
             allow: tuple[str, ...] | None = None, **kwargs: Any) -> CallOutcome:  # fmt: skip
        run = run or new_run()
        ctx = SandboxContext(
            workdir=run, timeout_s=timeout, policy=policy or SandboxPolicy(),
            on_tick=on_tick or (lambda: True), strict=self.strict, mode=self.mode,
            sandbox_root=runs_root(), allow=allow,
        )  # fmt: skip
        if not (self.reuse and os.path.dirname(os.path.abspath(run)) == runs_root() and IS_ROOT):
            return run_call(fn, kwargs, ctx)
        return self.reused(fn, kwargs, ctx)

    @staticmethod
    def reused(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext) -> CallOutcome:
        """As the worker runs a run's calls (reuse on): a first call of the run, then this
        one, in the process that served the first; then the run's process is let go."""
        ctx.run_id, ctx.defer_cleanup = os.path.basename(ctx.workdir), True
        first = SandboxContext(ctx.workdir, 30, ctx.policy, mode=ctx.mode, sandbox_root=ctx.sandbox_root,
                               run_id=ctx.run_id, defer_cleanup=True)  # fmt: skip
        before = run_call(hostile.identity, {}, first)
        sandbox.settle()
        if sandbox.spare._served.get(os.getpid()) is not None:  # only the fork server's spares stay
            assert before.ok and sandbox.reuse.kept_pid(ctx.run_id) == before.output["pid"], before
        try:
            return run_call(fn, kwargs, ctx)
        finally:
            sandbox.settle()
            sandbox.reuse.forget(ctx.run_id)

    def ok(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        outcome = self.call(fn, **kwargs)
        assert outcome.ok, outcome.error
        return outcome.output

    def fails(self, fn: Callable[..., Any], **kwargs: Any) -> str:
        """The attempt started inside the sandbox (the tool ran) and was refused: a call that
        could not even start (``SandboxError``) does not count as contained."""
        outcome = self.call(fn, **kwargs)
        assert not outcome.ok, f"{self.name}: the attempt succeeded: {outcome.output!r}"
        assert outcome.error and not outcome.error.startswith("SandboxError"), outcome.error
        return outcome.error


def started(outcome: CallOutcome) -> bool:
    """The tool ran (whatever it then returned or raised): not refused before it started."""
    return outcome.ok or not (outcome.error or "SandboxError").startswith("SandboxError")


@pytest.fixture(params=[("fork", "basic", False, False), ("fork", "basic", False, True),
                        ("exec", "basic", True, False), ("bwrap", "bwrap", True, False)],
                ids=["fork", "fork-reused", "exec", "bwrap"])  # fmt: skip
def layer(request: pytest.FixtureRequest) -> Layer:
    name, mode, strict, reuse = request.param
    if name == "bwrap" and not BWRAP:
        pytest.skip(NO_BWRAP)
    if reuse and not IS_ROOT:
        pytest.skip("a process serves several calls of a run only under a uid of its own (root worker)")
    return Layer(name, mode, strict, reuse)


@pytest.fixture
def bwrap_layer() -> Layer:
    if not BWRAP:
        pytest.skip(NO_BWRAP)
    return Layer("bwrap", "bwrap", True)


# -- the run folder works ---------------------------------------------------------------
def test_the_first_calls_of_a_run_in_parallel_all_get_its_temp_folder(tmp_path: Path) -> None:
    """Each call makes the run's temp folder if it is missing: the first calls of a run,
    in several pool processes at once, raced between looking and making ("File exists"
    refused all but one: seen in a clean CI run). 8 processes x 40 new folders."""
    folders = [tmp_path / f"run-{n}" for n in range(40)]
    for folder in folders:
        folder.mkdir()
    children, (go_r, go_w) = [], os.pipe()
    for _ in range(8):
        pid = os.fork()
        if pid == 0:  # each child makes every folder's .tmp, racing its siblings
            code = 0
            try:
                os.close(go_w)
                os.read(go_r, 1)  # all start together: when the parent closes its end
                for folder in folders:
                    sandbox.folders.make_tmp(str(folder), None)
            except BaseException:
                code = 1
            os._exit(code)
        children.append(pid)
    os.close(go_r)
    os.close(go_w)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    assert codes == [0] * 8
    assert all((folder / ".tmp").is_dir() for folder in folders)


def test_the_run_folder_works_and_is_shared_by_the_calls_of_a_run(layer: Layer) -> None:
    run = new_run()
    assert layer.ok(hostile.append_text, run=run, name="log.txt", text="one ") == "one "
    assert layer.ok(hostile.append_text, run=run, name="log.txt", text="two") == "one two"
    assert layer.ok(builtins.write_file, run=run, path="sub/a.txt", content="héllo", sandbox_root=run) == 5
    assert layer.ok(builtins.read_file, run=run, path="sub/a.txt", sandbox_root=run) == "héllo"
    tmp = [] if layer.bwrap else [".tmp/"]  # the run's own TMPDIR outside bwrap
    assert layer.ok(builtins.list_dir, run=run, sandbox_root=run) == [*tmp, "log.txt", "sub/"]
    out = layer.ok(builtins.shell, run=run, command="cat sub/a.txt log.txt && pwd", sandbox_root=run)
    assert out == {"exit_code": 0, "stdout": f"hélloone two{os.path.realpath(run)}\n", "stderr": ""}
    assert Path(run, "log.txt").read_text() == "one two"  # on the host, where the worker reads it


@needs_root
def test_each_call_has_its_own_uid_in_the_runs_group(layer: Layer) -> None:
    run = new_run()
    first = layer.ok(hostile.identity, run=run)
    second = layer.ok(hostile.identity, run=run)
    gid = os.stat(run).st_gid
    assert oct(os.stat(run).st_mode & 0o7777) == "0o2770" and sandbox.folders._is_run_gid(gid)
    for ident in (first, second):
        assert sandbox.UID_BASE <= ident["uid"] < sandbox.UID_BASE + sandbox.UID_SPAN
        assert ident["euid"] == ident["uid"] and ident["gid"] == gid and ident["groups"] == [gid]
        assert ident["cwd"] == os.path.realpath(run)
        assert ident["no_new_privs"] == "1" and ident["sid"] != os.getsid(0)  # a session of its own
        limits = ident["limits"]
        assert limits["RLIMIT_CPU"][0] < limits["RLIMIT_CPU"][1]
        assert limits["RLIMIT_NPROC"] == [64, 64] and limits["RLIMIT_CORE"] == [0, 0]
        assert limits["RLIMIT_NOFILE"][0] >= 256 and limits["RLIMIT_FSIZE"][0] == 256 << 20
    assert first["uid"] != second["uid"]


@needs_root
def test_uids_come_from_a_host_wide_counter_not_from_pids(layer: Layer) -> None:
    """Issue 15 hole 6: with uid = UID_BASE + pid, a later call that got the same pid (maybe
    another tenant's) inherited what the first left in /tmp or /dev/shm."""
    run = new_run()
    seen = [layer.ok(hostile.identity, run=run) for _ in range(3)]
    uids = [s["uid"] for s in seen]
    assert len(set(uids)) == 3
    assert all(sandbox.UID_BASE < u < sandbox.UID_BASE + sandbox.UID_SPAN for u in uids)
    if not layer.bwrap:  # (bwrap: pids of its own namespace)
        assert all(s["uid"] != sandbox.UID_BASE + s["pid"] for s in seen), seen
    env = layer.ok(hostile.environment, run=run)
    if layer.bwrap:
        assert env["TMPDIR"] == "/tmp"  # bwrap's private tmpfs
    else:  # the run's own temp folder, not the host's /tmp
        tmp = os.path.join(os.path.realpath(run), ".tmp")
        assert env["TMPDIR"] == env["TMP"] == env["TEMP"] == tmp
        assert os.stat(tmp).st_gid == os.stat(run).st_gid and oct(os.stat(tmp).st_mode & 0o7777) == "0o2770"
        assert layer.ok(hostile.write_path, run=run, path=os.path.join(tmp, "t"), text="x") == "written"


def test_layers_tell_the_truth(layer: Layer) -> None:
    reported = layers(layer.mode)
    assert reported["bwrap"] is reported["netns"] is reported["pidns"] is layer.bwrap
    assert reported["setuid"] is reported["nproc"] is IS_ROOT
    assert reported["fork"] and reported["rlimits"]
    ident = layer.ok(hostile.identity)
    assert (ident["hostname"] == "tooloop") is layer.bwrap  # bwrap's own uts namespace
    assert (ident["pid"] <= 3) is layer.bwrap  # bwrap's own pid namespace


# -- writing and reading outside ----------------------------------------------------------
def test_writing_outside_the_run_folder_fails(layer: Layer) -> None:
    for target in (f"/etc/tooloop-pwned-{uuid.uuid4().hex}", f"/usr/tooloop-pwned-{uuid.uuid4().hex}"):
        error = layer.fails(hostile.write_path, path=target, text="x")
        assert "Error" in error and not os.path.exists(target), error
    sibling = os.path.join(runs_root(), f"pwned-{uuid.uuid4().hex}")  # next to every run's folder
    host_tmp = f"/tmp/tooloop-pwned-{uuid.uuid4().hex}"  # world-writable: only Landlock (or bwrap) stops it
    if IS_ROOT or layer.bwrap or LANDLOCK:  # else the call is the worker's user, who owns the root
        outcome = layer.call(hostile.write_path, path=sibling, text="x")  # under bwrap: into a tmpfs, maybe
        assert started(outcome) and not os.path.exists(sibling), outcome
    if layer.bwrap or LANDLOCK:
        outcome = layer.call(hostile.write_path, path=host_tmp, text="x")
        error = outcome.error or ""
        assert started(outcome) and not os.path.exists(host_tmp), outcome
        assert layer.bwrap or error.startswith("PermissionError"), error
    assert layer.ok(hostile.write_path, path="inside.txt", text="x") == "written"


def test_other_runs_folders_are_out_of_reach(layer: Layer) -> None:
    if not (IS_ROOT or layer.bwrap or LANDLOCK):
        pytest.skip(f"a non-root worker without bwrap and Landlock runs every call as its own user: {KERNEL}")
    victim, attacker = new_run(), new_run()
    layer.ok(hostile.append_text, run=victim, name="secret.txt", text="s3cret")
    secret = os.path.join(victim, "secret.txt")
    assert Path(secret).read_text() == "s3cret"  # the worker itself can read it: the file is there
    layer.fails(hostile.read_path, run=attacker, path=secret)
    layer.fails(hostile.list_path, run=attacker, path=victim)
    layer.fails(hostile.write_path, run=attacker, path=os.path.join(victim, "planted.txt"), text="x")
    assert not os.path.exists(os.path.join(victim, "planted.txt"))
    if layer.bwrap:  # every other run is hidden, not only closed
        assert layer.ok(hostile.list_path, run=attacker, path=runs_root()) == [os.path.basename(attacker)]
    else:  # the folder of all runs can be crossed, not listed
        layer.fails(hostile.list_path, run=attacker, path=runs_root())


# Not under bwrap: its mounts hide every other run (test_other_runs_are_out_of_reach).
@pytest.mark.parametrize("layer", [("fork", "basic", False, False), ("fork", "basic", False, True),
                                   ("exec", "basic", True, False)],
                         ids=["fork", "fork-reused", "exec"], indirect=True)  # fmt: skip
def test_landlock_alone_keeps_other_runs_out(layer: Layer, monkeypatch) -> None:
    """A call without a uid of its own (a worker that is not root) can read whatever the
    worker's user can: Landlock keeps the folders of all runs out of its reach. Shown here
    on a neighbour left world-readable, so that nothing but Landlock stands in the way."""
    if not LANDLOCK:
        pytest.skip(KERNEL["landlock"])
    victim, attacker = new_run(), new_run()
    layer.ok(hostile.append_text, run=victim, name="secret.txt", text="s3cret")
    secret = os.path.join(victim, "secret.txt")
    os.chmod(victim, 0o2775)
    os.chmod(secret, 0o644)
    assert layer.ok(hostile.read_path, run=attacker, path=secret) == "s3cret"  # the control: readable
    monkeypatch.setattr(sandbox.plan, "_hides_runs", lambda uid, layer: True)  # as on a non-root worker
    assert layer.fails(hostile.read_path, run=attacker, path=secret).startswith("PermissionError")
    assert layer.fails(hostile.list_path, run=attacker, path=victim).startswith("PermissionError")
    layer.fails(hostile.write_path, run=attacker, path=os.path.join(victim, "planted.txt"), text="x")
    assert not os.path.exists(os.path.join(victim, "planted.txt"))
    other = os.path.join(allow_root(), f"proj-{uuid.uuid4().hex[:6]}")  # TOOLOOP_SANDBOX_ALLOW's too
    os.makedirs(other)
    Path(other, "notes.txt").write_text("theirs")
    os.chmod(Path(other, "notes.txt"), 0o644)
    assert layer.fails(hostile.read_path, run=attacker, path=os.path.join(other, "notes.txt"))
    # What stays: the host's files, Python, its own folder.
    hostname = Path("/etc/hostname").read_text()
    assert layer.ok(hostile.read_path, run=attacker, path="/etc/hostname") == hostname
    assert layer.ok(hostile.append_text, run=attacker, name="mine.txt", text="ok") == "ok"
    command = "cat mine.txt; python3 -c 'print(6*7)'"
    out = layer.ok(builtins.shell, run=attacker, sandbox_root=attacker, command=command)
    assert out["stdout"] == "ok42\n", out


OTHER_USER = 0x5E00_0000 + random.randint(1, 1 << 20)  # owns a checkout: neither root nor a sandbox uid


@needs_root
def test_a_folder_the_run_was_given_works_whoever_owns_it(layer: Layer) -> None:
    """Issue 29: a spec's ``context.sandbox_root`` under an allowed root, made (checked out)
    by a user of the host. Run as root without capabilities, bubblewrap could not enter the
    folder (its owner's, the run's group: not root's), so every strict call ended
    ``Crashed: tool process exited 1`` and its shell never ran."""
    checkout = Path(allow_root(), f"checkout-{uuid.uuid4().hex[:6]}")
    folder = checkout / "repo"
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("from the checkout\n")
    for path in (checkout, folder, folder / "README.md"):
        os.chown(path, OTHER_USER, OTHER_USER)
    run = str(folder)
    command = "cat README.md && echo new > new.txt && pwd"
    out = layer.ok(builtins.shell, run=run, sandbox_root=run, command=command)
    assert out == {"exit_code": 0, "stdout": f"from the checkout\n{run}\n", "stderr": ""}, out
    assert layer.ok(builtins.write_file, run=run, sandbox_root=run, path="a.txt", content="written") == 7
    assert layer.ok(builtins.read_file, run=run, sandbox_root=run, path="a.txt") == "written"
    assert layer.ok(hostile.append_text, run=run, name="new.txt", text="more") == "new\nmore"
    assert layer.ok(hostile.identity, run=run)["cwd"] == run
    assert (folder / "new.txt").read_text() == "new\nmore" and folder.stat().st_uid == OTHER_USER


@pytest.fixture
def var_tmp_root() -> Iterator[str]:
    """An allowed root outside /tmp (bwrap's private /tmp hides whatever is in the host's)."""
    root = tempfile.mkdtemp(prefix="tooloop-allow-", dir="/var/tmp")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_every_folder_of_runs_is_hidden_under_bwrap(bwrap_layer: Layer, var_tmp_root: str) -> None:
    """bwrap hides the folders of all runs: the sandbox root's and every allowed root's (a
    worker that is not root runs every call as its own user: only these mounts, or Landlock
    outside bwrap, keep a call out of the other runs' folders)."""
    allow = (allow_root(), var_tmp_root)
    neighbour = Path(var_tmp_root, f"proj-{uuid.uuid4().hex[:6]}")
    neighbour.mkdir()
    (neighbour / "notes.txt").write_text("theirs")
    mine = str(Path(var_tmp_root, f"proj-{uuid.uuid4().hex[:6]}", "deeper"))
    layer = bwrap_layer
    assert layer.ok(hostile.list_path, path=var_tmp_root, allow=allow) == []  # from a default folder
    assert layer.ok(hostile.list_path, run=mine, path=var_tmp_root, allow=allow) == [Path(mine).parent.name]
    assert layer.ok(hostile.list_path, run=mine, path=runs_root(), allow=allow) == []
    error = layer.fails(hostile.read_path, run=mine, path=str(neighbour / "notes.txt"), allow=allow)
    assert error.startswith("FileNotFoundError"), error
    assert layer.ok(hostile.append_text, run=mine, name="mine.txt", text="ok", allow=allow) == "ok"


def test_an_allowed_root_in_a_closed_home_works_under_bwrap(bwrap_layer: Layer, var_tmp_root: str) -> None:
    """An allowed root in a home its owner keeps closed (0750): the call's uid may not search
    the way to its folder on the host; under bwrap that home is an empty tmpfs with the way
    down made again (outside bwrap the built-ins, which use the absolute path, cannot)."""
    home = Path(var_tmp_root)  # not an allowed root itself: only its work/ is
    home.chmod(0o750)
    if IS_ROOT:  # (someone else's)
        os.chown(home, OTHER_USER, OTHER_USER)
    (home / "work").mkdir()
    folder = str(home / "work" / "proj")
    out = bwrap_layer.ok(builtins.shell, run=folder, sandbox_root=folder, command="pwd; ls ..",
                         allow=(str(home / "work"),))  # fmt: skip
    assert out == {"exit_code": 0, "stdout": f"{folder}\nproj\n", "stderr": ""}, out


def test_a_call_that_cannot_start_says_why(layer: Layer, monkeypatch, caplog) -> None:
    """A call whose sandbox fails before the tool runs (bubblewrap cannot make a mount, the
    interpreter dies at start, a forked process cannot enter the run's folder) is a
    ``SandboxError`` with the message of what failed, not ``Crashed: tool process exited
    1`` (which escape tests would take for "contained"); the worker's log says it once."""
    missing = f"/nonexistent-{uuid.uuid4().hex[:6]}"
    if layer.name == "fork":  # the forked process reports its own start failure on its result pipe
        from worker.sandbox import child, spare, spare_child

        monkeypatch.setenv("TOOLOOP_SANDBOX_FORK_SERVER", "0")  # forked here, where the patch is
        monkeypatch.setattr(spare, "_spares", {})  # (no spare forked before it)
        monkeypatch.setattr(child, "_enter", lambda plan: os.chdir(missing))
        monkeypatch.setattr(spare_child, "_enter", lambda plan: os.chdir(missing))  # (a spare's too)
        expected = f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'"
    elif layer.bwrap:
        bwrap_argv = sandbox.plan._bwrap_argv

        def broken(*args: Any) -> list[str]:  # a mount bubblewrap cannot make
            return [*bwrap_argv(*args), "--ro-bind", missing, "/x"]

        monkeypatch.setattr(sandbox.plan, "_bwrap_argv", broken)
        expected = f"bwrap: Can't find source path {missing}"
    else:
        dies = f"import sys; sys.stderr.write('cannot start: {missing}\\n'); sys.exit(3)"
        monkeypatch.setattr(sandbox.plan, "_runner_source", lambda: dies)
        expected = f"cannot start: {missing}"
    caplog.set_level("WARNING", logger="worker.sandbox.call")
    for _ in range(2):
        error = layer.call(hostile.identity).error or ""
        assert error.startswith("SandboxError") and expected in error, error
    logged = [r.getMessage() for r in caplog.records if expected in r.getMessage()]
    assert len(logged) == 1, logged


def test_a_call_that_crashes_after_it_started_says_why(layer: Layer) -> None:
    """Issue 29: a tool that started and then died (a segfault in C code) is not "exited N"
    alone. In the exec layers the runner marks that the tool started and keeps the
    interpreter's fatal-signal report (faulthandler): the error names the signal, Python's
    fatal error and the tool's frame. A forked call (its stderr is /dev/null) names the signal."""
    error = layer.call(hostile.segfault).error or ""
    if layer.name == "fork":
        assert error.startswith("Killed: tool process died on SIGSEGV"), error
        return
    said = "Crashed: tool process died on SIGSEGV: Fatal Python error: Segmentation fault"
    assert error.startswith(said), error
    assert 'hostile_tools.py", line' in error and "in segfault" in error, error
    assert "could not start" not in error and "tooloop: the tool started" not in error, error


def test_tmp_files_of_the_host_are_not_readable(layer: Layer) -> None:
    private = Path(f"/tmp/tooloop-secret-{uuid.uuid4().hex}")
    private.write_text("private")
    private.chmod(0o600)
    shared = Path(f"/tmp/tooloop-shared-{uuid.uuid4().hex}")
    shared.write_text("shared")
    shared.chmod(0o644)
    try:
        if IS_ROOT or layer.bwrap:
            assert "Error" in layer.fails(hostile.read_path, path=str(private))
        if layer.bwrap:  # a private /tmp: nothing of the host's, and nothing back to it
            assert "FileNotFoundError" in layer.fails(hostile.read_path, path=str(shared))
            planted = f"/tmp/tooloop-planted-{uuid.uuid4().hex}"
            assert layer.ok(hostile.write_path, path=planted, text="x") == "written"
            assert not os.path.exists(planted)
    finally:
        private.unlink()
        shared.unlink()


@needs_root
def test_the_workers_environment_cannot_be_read_through_proc(layer: Layer) -> None:
    layer.fails(hostile.read_path, path=f"/proc/{os.getpid()}/environ")


# -- secrets and the worker's connections -------------------------------------------------
# What a call may get of the worker's environment (worker/sandbox/env.py), and what the
# shell or bubblewrap set in the call itself (not inherited: their own values).
ALLOWED_ENV = {"PATH", "HOME", "TMPDIR", "TMP", "TEMP", "TEMPDIR", "LANG", "TERM",
               *sandbox.constants.ENV_PASSTHROUGH}
MADE_IN_THE_CALL = {"PWD", "OLDPWD", "SHLVL", "_"}


def foreign(names: Iterator[str] | dict[str, str] | list[str], worker_env: dict[str, str]) -> set[str]:
    """Variables of the worker's environment that a call got, beyond the allowlist."""
    return (set(names) & set(worker_env)) - ALLOWED_ENV - MADE_IN_THE_CALL


def env_names(lines: list[str]) -> list[str]:
    """``NAME=value`` lines (``env``'s output, the C library's block) -> the names."""
    return [line.split("=", 1)[0] for line in lines]


@pytest.fixture
def worker_env_secrets(monkeypatch) -> Iterator[dict[str, str]]:
    """This process as a worker whose environment holds what deployments put there: a Redis
    password (the k8s manifests set REDIS_PASSWORD), provider keys, cloud credentials, a
    variable nobody listed; and one set in the C library behind os.environ's back."""
    tag = uuid.uuid4().hex[:8]
    secrets = {"REDIS_PASSWORD": f"redis-pw-{tag}", "ANTHROPIC_API_KEY": f"sk-ant-{tag}",
               "AWS_SECRET_ACCESS_KEY": f"aws-{tag}", f"UNLISTED_{tag.upper()}": f"x-{tag}"}  # fmt: skip
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    libc = sandbox.libc._libc()
    stray = f"STRAY_{tag.upper()}"
    libc.setenv(stray.encode(), f"stray-{tag}".encode(), 1)
    try:
        yield {**secrets, stray: f"stray-{tag}"}
    finally:
        libc.unsetenv(stray.encode())


def test_no_variable_of_the_workers_environment_reaches_a_call(layer: Layer, worker_env_secrets,
                                                               monkeypatch) -> None:  # fmt: skip
    """Issue 22 item 8: every call's environment, and the fork server's (every forked call
    copies its memory), is the allowlist alone, not the worker's minus a denylist. Checked
    on every variable of this worker's environment, with the fork server on and off, and
    on variables set after the fork server started (and after the first call)."""
    assert os.environ["OPENAI_API_KEY"] == "sk-test" and os.environ["TOOLOOP_SECRET_KEY"] == "test-secret"
    values = [*worker_env_secrets.values(), "sk-test", "test-secret"]
    for fork_server in ("1", "0") if layer.name == "fork" else ("1",):
        monkeypatch.setenv("TOOLOOP_SANDBOX_FORK_SERVER", fork_server)
        if fork_server == "1" and layer.name == "fork":
            server = fresh_server()  # started now: with this environment around it
            with open(f"/proc/{server.pid}/environ", "rb") as f:
                block = f.read().decode(errors="replace")
            names = {item.split("=", 1)[0] for item in block.split("\0") if "=" in item}
            assert {n for n in names - ALLOWED_ENV if not n.startswith("TOOLOOP_ZYGOTE_")} == set(), names
            assert not [v for v in values if v in block]
        late = f"late-{uuid.uuid4().hex[:8]}"
        monkeypatch.setenv("LATE_SECRET", late)  # after the server started, and after earlier calls
        env = layer.ok(hostile.environment)
        c_env = layer.ok(hostile.c_environment)
        run = new_run()
        shell = layer.ok(builtins.shell, command="env", sandbox_root=run, run=run)["stdout"].splitlines()
        worker_env = {**os.environ, **worker_env_secrets}
        for seen in (env, env_names(c_env), env_names(shell)):
            assert foreign(seen, worker_env) == set(), (fork_server, seen)
        text = json.dumps([env, c_env, shell])
        assert not [v for v in [*values, late] if v in text], (fork_server, text)
        assert env["PATH"] and "PATH" in env_names(shell)
        block = layer.call(hostile.proc_environ)  # the kernel's copy: unreadable (not dumpable), or clean
        assert started(block), block
        assert not block.ok or not [v for v in [*values, late] if v in block.output]


def test_inherited_connections_are_closed(layer: Layer) -> None:
    with socket.create_connection((REDIS.hostname, REDIS.port or 6379)) as redis:
        redis.sendall(b"PING\r\n")
        assert redis.recv(64) == b"+PONG\r\n"  # a live Redis connection, for the call to inherit
        assert layer.ok(hostile.use_inherited_sockets) == []
        fds = layer.ok(hostile.inherited_fds)
    assert not [t for t in fds.values() if t.startswith("socket:")], fds


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP server on a free loopback port that answers PING with +PONG (not Redis, not the
    broker: the control that shows a call with network on really has it)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(64)
                    conn.sendall(b"+PONG\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


NETWORK_CUT = ("PermissionError", "OSError: [Errno 101]")  # Landlock/seccomp EACCES; bwrap's empty netns


def test_without_network_no_tcp_at_all(layer: Layer, listener: int) -> None:
    if not (layer.bwrap or (LANDLOCK_NET and SECCOMP)):
        pytest.skip(f"no layer here cuts the network outside bwrap: {KERNEL}")
    for host, port in ((REDIS.hostname, REDIS.port or 6379), ("127.0.0.1", listener), ("127.0.0.1", 5672)):
        error = layer.fails(hostile.connect, host=host, port=port)
        assert error.startswith(NETWORK_CUT), error  # the tool ran, and its connect was refused
    run = new_run()
    probe = f"bash -c 'echo PING > /dev/tcp/127.0.0.1/{listener}' && echo connected"
    out = layer.ok(builtins.shell, run=run, command=probe, sandbox_root=run)
    assert out["exit_code"] != 0 and "connected" not in out["stdout"], out
    assert "Permission denied" in out["stderr"] or "unreachable" in out["stderr"], out


def test_redis_and_the_broker_stay_out_of_reach_with_network_on(layer: Layer, listener: int,
                                                                monkeypatch) -> None:  # fmt: skip
    """Issue 15 hole 4: whatever its policy, a call never reaches Redis or the broker."""
    if not LANDLOCK_NET:
        policy = SandboxPolicy(network=True)
        error = layer.fails(hostile.connect, host="127.0.0.1", port=listener, policy=policy)
        assert "policy.network is on" in error  # refused before it starts: nothing else could stop it
        return
    monkeypatch.setenv("TOOLOOP_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")  # the broker: RabbitMQ
    get_settings.cache_clear()
    try:
        policy = SandboxPolicy(network=True)
        assert layer.ok(hostile.connect, host="127.0.0.1", port=listener, policy=policy) == "+PONG\r\n"
        for host, port in ((REDIS.hostname, REDIS.port or 6379), ("127.0.0.1", 5672), ("::1", 5672)):
            error = layer.fails(hostile.connect, host=host, port=port, policy=policy)
            assert error.startswith("PermissionError") or "Errno 99" in error or "Errno 97" in error, error
        run = new_run()
        probe = f"bash -c 'echo PING > /dev/tcp/{REDIS.hostname}/{REDIS.port or 6379}' && echo connected"
        out = layer.ok(builtins.shell, run=run, command=probe, sandbox_root=run, policy=policy)
        assert "connected" not in out["stdout"] and "Permission denied" in out["stderr"], out
    finally:
        get_settings.cache_clear()


# -- resources ---------------------------------------------------------------------------------
def test_allocating_6_gib_fails_and_the_next_call_works(layer: Layer) -> None:
    error = layer.fails(hostile.allocate, gib=6)
    assert error.startswith(("MemoryError", "Killed")), error
    assert layer.ok(hostile.allocate, gib=0.01) == int(0.01 * (1 << 30))


@needs_root
def test_a_fork_bomb_is_bounded_and_leaves_nothing(layer: Layer) -> None:
    policy = SandboxPolicy(max_processes=32)
    out = layer.ok(hostile.fork_bomb, limit=5000, seconds=120, policy=policy)
    assert 0 < out["forks"] < 32, out
    assert gone(lambda: of_uid(out["uid"]))
    assert subprocess.run(["true"], check=False).returncode == 0  # this process still forks


def test_cpu_time_is_limited(layer: Layer) -> None:
    started = time.monotonic()
    error = layer.fails(hostile.burn_cpu, seconds=60, policy=SandboxPolicy(cpu_s=1), timeout=30)
    assert error.startswith("Killed") and ("SIGXCPU" in error or "SIGKILL" in error), error
    assert time.monotonic() - started < 10


def test_open_files_are_limited_however_many_the_worker_holds(layer: Layer) -> None:
    """max_open_files counts what the call opens. The forked call keeps the worker's
    descriptor numbers (on /dev/null): with a limit counted from zero, a worker holding
    more than 256 left its calls nothing, not even Landlock's ruleset (EMFILE)."""
    policy = SandboxPolicy(max_open_files=64)
    for extra in (0, 400):  # a worker with few descriptors, then one with hundreds
        opened = [os.open("/dev/null", os.O_RDONLY) for _ in range(extra)]
        try:
            got = layer.ok(hostile.open_until_refused, policy=policy)
        finally:
            for fd in opened:
                os.close(fd)
        assert got["error"] == "Too many open files" and 56 <= got["opened"] <= 68, (extra, got)


def test_file_size_is_limited(layer: Layer) -> None:
    error = layer.fails(hostile.big_file, mb=3, policy=SandboxPolicy(max_file_mb=1))
    assert "File too large" in error, error


def du(path: str) -> int:
    return sandbox.quota.usage(path, 1 << 62)


def test_the_run_folder_has_a_disk_quota(layer: Layer) -> None:
    """Issue 15 item 7: RLIMIT_FSIZE bounds one file; the folder as a whole has a quota too."""
    run, mb = new_run(), 1 << 20
    policy = SandboxPolicy(max_disk_mb=8, max_file_mb=256)
    error = layer.fails(hostile.big_file, run=run, mb=12, policy=policy)  # one file: at most what is left
    assert "File too large" in error and du(run) <= 8 * mb + (1 << 16), (error, du(run))
    os.unlink(os.path.join(run, "big.bin"))
    started = time.monotonic()  # many files, slowly: the watch counts every second
    error = layer.fails(hostile.fill_disk, run=run, files=40, mb=1, pause=0.1, policy=policy)
    assert error.startswith("DiskQuota") and "8 MiB" in error, error
    assert time.monotonic() - started < 8 and 8 * mb < du(run) < 24 * mb, du(run)  # (overshoot: one tick)
    # Over its quota, a call can still read, list and delete, not grow a file.
    error = layer.fails(hostile.append_text, run=run, name="more.txt", text="x", policy=policy)
    assert "File too large" in error, error
    assert "fill-0.bin" in layer.ok(builtins.list_dir, run=run, sandbox_root=run, policy=policy)
    out = layer.ok(builtins.shell, run=run, sandbox_root=run, policy=policy, command="rm fill-* && echo ok")
    assert out["stdout"] == "ok\n", out
    assert layer.ok(hostile.append_text, run=run, name="more.txt", text="x", policy=policy) == "x"
    if layer.bwrap:  # its private /tmp is memory: no larger than the quota
        out = layer.ok(builtins.shell, run=run, sandbox_root=run, policy=policy, command="df -k /tmp|tail -1")
        assert out["stdout"].split()[1] == str(8 * 1024), out


def test_what_a_given_folder_held_before_counts_into_its_quota(layer: Layer) -> None:
    """Issue 29: a spec's own folder (a checkout under an allowed root) is the run's folder
    with what it held before the run, and that content counts into ``max_disk_mb``
    (docs/sandbox.md): 6 MiB already there leave a 4 MiB file no room under 8 MiB."""
    folder = Path(allow_root(), f"checkout-{uuid.uuid4().hex[:6]}")
    folder.mkdir()
    (folder / "prior.bin").write_bytes(b"x" * (6 << 20))
    policy = SandboxPolicy(max_disk_mb=8, max_file_mb=256)
    error = layer.fails(hostile.big_file, run=str(folder), mb=4, policy=policy)
    assert "File too large" in error and du(str(folder)) <= (8 << 20) + (1 << 16), (error, du(str(folder)))
    os.unlink(folder / "big.bin")  # (cut at the room that was left: 2 MiB)
    assert layer.ok(hostile.big_file, run=str(folder), mb=1, policy=policy) == 1  # that room is usable


# -- killing the whole tree ---------------------------------------------------------------------
def test_setsid_children_do_not_outlive_the_call(layer: Layer) -> None:
    mark = marker()
    out = layer.ok(hostile.escape, marker=mark, wait=0.3)
    assert out["seen"] >= 2  # both sleepers were running when the call returned
    assert gone(lambda: alive(mark)), f"{alive(mark)} outlived the call"


def test_setsid_children_die_at_the_deadline(layer: Layer) -> None:
    mark = marker()
    started = time.monotonic()
    error = layer.fails(hostile.escape, marker=mark, wait=120, timeout=1.5)
    assert error.startswith("Timeout") and time.monotonic() - started < 5
    assert gone(lambda: alive(mark))


def test_ignoring_sigterm_does_not_help(layer: Layer) -> None:
    mark = marker()
    started = time.monotonic()
    error = layer.fails(hostile.ignore_sigterm, marker=mark, seconds=120, timeout=1)
    assert error.startswith("Timeout") and time.monotonic() - started < 4, error
    assert gone(lambda: alive(mark))


def test_abort_kills_the_call_and_its_children(layer: Layer) -> None:
    mark = marker()
    started = time.monotonic()
    error = layer.fails(hostile.escape, marker=mark, wait=120,
                        on_tick=lambda: time.monotonic() - started < 1.0)  # fmt: skip
    assert error.startswith("Aborted") and time.monotonic() - started < 4
    assert gone(lambda: alive(mark))


def test_nothing_is_left_behind_not_even_zombies(layer: Layer) -> None:
    layer.ok(hostile.identity)  # this process's sandbox fork server, if any, is up before counting
    before = set(sandbox.reaper._children())
    for _ in range(3):
        layer.ok(hostile.escape, marker=marker(), wait=0)
        layer.fails(hostile.escape, marker=marker(), wait=60, timeout=0.5)
    time.sleep(0.2)
    layer.ok(hostile.identity)  # its sweep reaps what died since the last one
    assert set(sandbox.reaper._children()) - before == set()


def test_a_failing_heartbeat_does_not_stop_the_call(layer: Layer) -> None:
    def on_tick() -> bool:
        raise ConnectionError("Redis away")

    assert layer.ok(hostile.burn_cpu, seconds=0.6, on_tick=on_tick) == "done"


class SoftTimeLimit(BaseException):
    """Like Celery's SoftTimeLimitExceeded: raised in the worker while it waits."""


def test_an_exception_in_the_worker_still_kills_the_call(layer: Layer) -> None:
    mark = marker()
    started = time.monotonic()

    def on_tick() -> bool:
        if time.monotonic() - started > 1.0:
            raise SoftTimeLimit()
        return True

    with pytest.raises(SoftTimeLimit):
        layer.call(hostile.escape, marker=mark, wait=120, on_tick=on_tick)
    assert gone(lambda: alive(mark))


def test_without_pidfd_the_watch_polls(layer: Layer, monkeypatch) -> None:
    """Where seccomp refuses pidfd_open (older Docker profiles)."""
    monkeypatch.setattr(sandbox.call, "_pidfd", lambda pid: None)
    assert layer.ok(hostile.append_text, name="a.txt", text="x") == "x"
    mark = marker()
    assert layer.fails(hostile.escape, marker=mark, wait=60, timeout=1).startswith("Timeout")
    assert gone(lambda: alive(mark))


# -- the fork server (worker/sandbox/zygote.py) ---------------------------------------------------
FORK = Layer("fork", "basic", False)
WORKER_MODULES = ["celery", "kombu", "redis", "orchestrator.store", "orchestrator.client", "worker.app"]


def fresh_server() -> zygote.Zygote:
    """This process's fork server, started anew (so that it sees the environment as it is now)."""
    server = zygote.restart()
    assert server is not None and server.alive()
    return server


def test_forked_calls_start_from_the_fork_server_not_the_worker(monkeypatch) -> None:
    """The worker forks nothing per call: a small interpreter without Celery, Redis clients
    or tooloop's settings forks each call's process (one per call, as before)."""
    monkeypatch.setenv("TOOLOOP_SECRET_KEY", f"sealing-{uuid.uuid4().hex[:6]}")
    server = fresh_server()
    first, second = FORK.ok(hostile.identity), FORK.ok(hostile.identity)
    assert first["ppid"] == second["ppid"] == server.pid != os.getpid()
    assert first["pid"] != second["pid"]
    for name in WORKER_MODULES:  # this process plays the worker
        __import__(name)
    assert FORK.ok(hostile.imported, names=WORKER_MODULES) == []  # in the call's
    with open(f"/proc/{server.pid}/environ", "rb") as f:
        env = [item.split(b"=", 1)[0].decode() for item in f.read().split(b"\0") if b"=" in item]
    assert "TOOLOOP_SECRET_KEY" in os.environ
    assert [k for k in env if k.startswith("TOOLOOP_") and not k.startswith("TOOLOOP_ZYGOTE_")] == []


def test_a_call_dies_with_its_fork_server_and_the_next_call_gets_a_new_server() -> None:
    server = fresh_server()
    mark = marker()
    outcome: list[CallOutcome] = []
    call = threading.Thread(target=lambda: outcome.append(FORK.call(hostile.escape, marker=mark, wait=30)))
    call.start()
    wait_for(lambda: alive(mark), 10)  # the tool started
    started = time.monotonic()
    os.kill(server.pid, signal.SIGKILL)
    call.join(15)
    assert not call.is_alive() and time.monotonic() - started < 10
    assert outcome[0].error and outcome[0].error.startswith("Killed"), outcome[0].error
    assert gone(lambda: alive(mark))  # what it started went with it
    again = FORK.ok(hostile.identity)
    assert again["ppid"] == zygote.for_this_process().pid != server.pid


def test_a_tool_the_fork_server_cannot_import_forks_from_the_worker() -> None:
    """A tool defined where a fresh interpreter cannot find it (here: inside a function)."""

    def where() -> int:
        """The parent of the call's process."""
        return os.getppid()

    fresh_server()
    tool(name=f"where_{uuid.uuid4().hex[:6]}")(where)
    try:
        assert FORK.ok(where) == os.getpid()
        assert FORK.ok(hostile.identity)["ppid"] != os.getpid()
    finally:
        for name in [n for n, t in REGISTRY.items() if t.fn is where]:
            del REGISTRY[name]


def _waiting_spares(server: zygote.Zygote) -> set[int]:
    """The fork server's children: spares it forked ahead, and calls' processes not yet reaped."""
    with open(f"/proc/{server.pid}/task/{server.pid}/children") as f:
        return {int(pid) for pid in f.read().split()}


def test_the_fork_server_forks_spares_ahead_between_bursts(monkeypatch) -> None:
    """Calls come in bursts: while no request comes, the server forks as many spares as it was
    asked for lately, at most TOOLOOP_SANDBOX_STOCK; the next burst's calls start in them,
    one process per call as before, each at the worker's priority (a server that may take a
    priority back, CAP_SYS_NICE, forks them at nice 19)."""
    monkeypatch.setenv("TOOLOOP_SANDBOX_STOCK", "6")
    server = fresh_server()
    burst = [FORK.ok(hostile.identity)["pid"] for _ in range(4)]
    wait_for(lambda: len(_waiting_spares(server)) == 4, 10)  # as many as were asked for
    ahead = _waiting_spares(server)
    niced = {os.getpriority(os.PRIO_PROCESS, pid) for pid in ahead}
    assert niced == ({19} if may_renice() else {os.getpriority(os.PRIO_PROCESS, 0)})
    calls = [FORK.ok(hostile.identity) for _ in range(4)]
    assert {c["pid"] for c in calls} == ahead and not ahead & set(burst)  # one process per call
    assert {c["nice"] for c in calls} == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert {c["ppid"] for c in calls} == {server.pid}
    for _ in range(10):  # a larger burst: the stock stops at its bound
        FORK.ok(hostile.identity)
    wait_for(lambda: len(_waiting_spares(server)) == 6, 10)
    time.sleep(0.5)
    assert len(_waiting_spares(server)) == 6


def test_spares_killed_while_waiting_cost_only_a_fresh_fork(monkeypatch) -> None:
    monkeypatch.setenv("TOOLOOP_SANDBOX_STOCK", "3")
    server = fresh_server()
    for _ in range(3):
        FORK.ok(hostile.identity)
    wait_for(lambda: len(_waiting_spares(server)) == 3, 10)
    ahead = _waiting_spares(server)
    for pid in ahead:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    again = FORK.ok(hostile.identity)
    assert again["pid"] not in ahead and again["ppid"] == server.pid


def test_by_default_no_stock_each_spare_is_forked_when_asked(monkeypatch) -> None:
    monkeypatch.delenv("TOOLOOP_SANDBOX_STOCK", raising=False)
    server = fresh_server()
    for _ in range(4):
        FORK.ok(hostile.identity)
    time.sleep(0.5)
    assert _waiting_spares(server) == set()


# -- the fork layer's copy of the worker's memory ----------------------------------------------------
@pytest.fixture
def worker_holding_secrets(monkeypatch) -> Iterator[tuple[str, str]]:
    """This process as a tool worker holding secrets: the sealing key (and its Fernet objects),
    a Redis URL with a password (the store's client, the Celery app's broker and backend)."""
    from orchestrator import secrets as sealing
    from worker import app as worker_app

    # A port bound and never listened on: connecting is refused, whatever else the suite
    # starts (a fixed 6390 was once taken by a test's Redis: the connection then stayed in use)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    password, key = f"hunter2-{uuid.uuid4().hex[:6]}", f"sealing-{uuid.uuid4().hex[:6]}"
    url = f"redis://:{password}@127.0.0.1:{closed.getsockname()[1]}/0"
    gc.disable()  # garbage not yet collected is copied by a fork too: the hunt must not depend on when
    try:
        monkeypatch.setenv("TOOLOOP_SECRET_KEY", key)
        monkeypatch.setenv("TOOLOOP_REDIS_URL", url)
        get_settings.cache_clear()
        worker_app.get_store.cache_clear()
        monkeypatch.setattr(worker_app.app, "tooloop_settings", get_settings())
        for name in ("broker_url", "result_backend"):
            monkeypatch.setitem(worker_app.app.conf, name, url)
        pool = worker_app.get_store().redis.connection_pool
        with contextlib.suppress(redis.ConnectionError):  # a connection made (it copies the password),
            pool.get_connection()  # left idle in the pool: nothing listens there
        assert pool._available_connections, "the pool kept no connection: the hunt would miss one"
        sealing.seal("x", tenant="t")
        yield password, key
    finally:
        gc.enable()
        closed.close()
        get_settings.cache_clear()
        worker_app.get_store.cache_clear()
        sealing._fernet.cache_clear()


def test_a_forked_call_finds_none_of_the_workers_secrets(layer: Layer, worker_holding_secrets) -> None:
    """Issue 15 item 7: a forked call is a copy of the worker's heap; before the tool runs it
    drops the worker's settings, clients and keys (the bytes may linger: docs/sandbox.md)."""
    password, key = worker_holding_secrets
    here = hostile.worker_secrets()  # the control: in the worker, the hunt finds them
    assert password in here["text"] and key in here["text"] and here["fernets"] >= 1
    found = layer.ok(hostile.worker_secrets)
    assert password not in found["text"] and key not in found["text"], found["text"][-3000:]
    assert found["fernets"] == 0


# -- built-in tools: escapes through paths --------------------------------------------------------
def test_file_tools_refuse_dotdot_absolute_and_symlink_escapes(layer: Layer) -> None:
    run = new_run()
    setup = "ln -s /etc/passwd pw && ln -s / rootlink && ln -s .. up && mkdir d && echo ok"
    assert layer.ok(builtins.shell, run=run, command=setup, sandbox_root=run)["stdout"] == "ok\n"
    attempts = [
        (builtins.read_file, {"path": "pw"}), (builtins.read_file, {"path": "../x"}),
        (builtins.read_file, {"path": "/etc/passwd"}), (builtins.read_file, {"path": "rootlink/etc/passwd"}),
        (builtins.read_file, {"path": "d/../../" + os.path.basename(run) + "/../x"}),
        (builtins.write_file, {"path": "../evil.txt", "content": "x"}),
        (builtins.write_file, {"path": "up/evil.txt", "content": "x"}),
        (builtins.write_file, {"path": "rootlink/tmp/evil.txt", "content": "x"}),
        (builtins.write_file, {"path": "/tmp/evil.txt", "content": "x"}),
        (builtins.list_dir, {"path": ".."}), (builtins.list_dir, {"path": "up"}),
        (builtins.list_dir, {"path": "/"}),
    ]  # fmt: skip
    for fn, kwargs in attempts:
        error = layer.fails(fn, run=run, sandbox_root=run, **kwargs)
        assert error.startswith("PathEscape:") and "outside the run's folder" in error, (kwargs, error)
    assert not os.path.exists(os.path.join(runs_root(), "evil.txt"))
    assert layer.ok(builtins.write_file, run=run, sandbox_root=run, path="d/../ok.txt", content="x") == 1
    assert layer.ok(builtins.read_file, run=run, sandbox_root=run, path=f"{run}/ok.txt") == "x"
    listing = [n for n in layer.ok(builtins.list_dir, run=run, sandbox_root=run) if n != ".tmp/"]
    assert listing == ["d/", "ok.txt", "pw", "rootlink", "up"]


def test_a_symlink_swapped_in_after_the_check_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The second line: even if the path check is raced, the open does not follow."""
    (tmp_path / "pw").symlink_to("/etc/passwd")
    (tmp_path / "dirlink").symlink_to("/etc")
    monkeypatch.setattr(builtins, "resolve_inside", lambda root, path: os.path.join(root, path))
    with pytest.raises(builtins.PathEscape):
        builtins.read_file("pw", str(tmp_path))
    with pytest.raises(builtins.PathEscape):
        builtins.read_file("dirlink/passwd", str(tmp_path))


# -- built-in tools: shell ---------------------------------------------------------------------
def test_shell_output_is_bounded_and_keeps_exit_code_and_stderr(layer: Layer) -> None:
    run = new_run()
    command = "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo tail; echo oops >&2; exit 3"
    out = layer.ok(builtins.shell, run=run, command=command, sandbox_root=run)
    assert out["exit_code"] == 3 and out["stderr"] == "oops\n"
    assert len(out["stdout"]) <= builtins.MAX_OUTPUT_CHARS + 100
    assert "bytes omitted" in out["stdout"] and out["stdout"].endswith("tail\n")


def test_shell_returns_despite_a_background_job(layer: Layer) -> None:
    run, mark = new_run(), marker()
    started = time.monotonic()
    out = layer.ok(builtins.shell, run=run, command=f"sleep {mark} & echo started", sandbox_root=run)
    assert out["stdout"] == "started\n" and time.monotonic() - started < 5
    assert gone(lambda: alive(mark))


def test_shell_command_allowlist(layer: Layer) -> None:
    run = new_run()
    policy = SandboxPolicy(allowed_commands=["echo", "ls"])
    command = "echo hi; rm -rf / $(id)"
    out = layer.ok(builtins.shell, run=run, command=command, sandbox_root=run, policy=policy)
    assert out["stdout"] == "hi; rm -rf / $(id)\n"  # words, not a shell: nothing else ran
    error = layer.fails(builtins.shell, run=run, command="rm -rf .", sandbox_root=run, policy=policy)
    assert error.startswith("CommandRefused") and "'rm'" in error
    layer.fails(builtins.shell, run=run, command="/bin/sh -c id", sandbox_root=run, policy=policy)


# Issue 15, hole 5: each of these ran a command the allowlist did not name (checked below with
# the allowlist off: the same command line, run by /bin/sh, does create its marker file).
SHELL_ESCAPES = [
    (["find"], "find . -maxdepth 0 -exec touch {mark} ;"),
    (["find"], "find . -maxdepth 0 -execdir touch {mark} ;"),
    (["sed"], "sed -n '1e touch {mark}' notes.txt"),
    (["sed"], "sed -n 's/.*/touch {mark}/e' notes.txt"),
    (["sed"], "sed -n --expression='1e touch {mark}' notes.txt"),
    (["tar"], "tar -xf a.tar --to-command='touch {mark}'"),
    (["tar"], "tar -xf a.tar --to-c='touch {mark}'"),
    (["tar"], "tar -xf a.tar --use-compress-program='sh -c \"touch {mark}\"'"),
    (["tar"], "tar -I 'sh -c \"touch {mark}\"' -xf a.tar"),
    (["tar"], "tar -xf a.tar --checkpoint=1 --checkpoint-action=exec='touch {mark}'"),
    (["awk"], "awk 'BEGIN {{ system(\"touch {mark}\") }}'"),
    (["awk"], "awk 'BEGIN {{ print \"x\" | \"touch {mark}\" }}'"),
    (["env"], "env touch {mark}"),
    (["xargs"], "xargs -a notes.txt touch {mark}"),
    (["make"], "make -f Makefile"),
    (["python3"], "python3 -c 'open(\"{mark}\", \"w\")'"),
    (["git"], "git -c core.fsmonitor='touch {mark}' status"),
    (["git"], "git status"),  # .git/config sets core.fsmonitor (written with write_file)
]


def shell_setup(layer: Layer, run: str, mark: str) -> None:
    setup = (f"echo hello > notes.txt && tar -cf a.tar notes.txt"
             f" && printf 'all:\\n\\ttouch {mark}\\n' > Makefile && git init -q ."
             f" && printf '[core]\\n\\tfsmonitor = touch {mark}\\n' >> .git/config && echo ok")
    assert layer.ok(builtins.shell, run=run, command=setup, sandbox_root=run)["stdout"] == "ok\n"


@pytest.mark.parametrize("allowed,command", SHELL_ESCAPES,
                         ids=[c.split()[0] + str(i) for i, (_, c) in enumerate(SHELL_ESCAPES)])  # fmt: skip
def test_the_shell_allowlist_refuses_executing_options(layer: Layer, allowed: list, command: str) -> None:
    run, mark = new_run(), f"pwned-{uuid.uuid4().hex[:6]}"
    shell_setup(layer, run, mark)
    line = command.format(mark=mark)
    as_words = shlex.join(shlex.split(line))  # what the allowlist runs, through sh: same argv
    if as_words.startswith("git "):  # each call has its own uid: git wants the repo declared safe
        as_words = "git -c safe.directory='*' " + as_words[4:]
    loose = layer.ok(builtins.shell, run=run, command=as_words, sandbox_root=run)  # no allowlist: it runs
    assert os.path.exists(os.path.join(run, mark)), (line, loose)  # the escape is real
    os.unlink(os.path.join(run, mark))
    policy = SandboxPolicy(allowed_commands=allowed)
    outcome = layer.call(builtins.shell, run=run, command=line, sandbox_root=run, policy=policy)
    refused = (outcome.error or "").startswith("CommandRefused") or (  # or GNU's own --sandbox refused it
        outcome.ok and outcome.output["exit_code"] != 0 and "sandbox mode" in outcome.output["stderr"])
    assert refused, (line, outcome)
    assert not os.path.exists(os.path.join(run, mark)), line


def test_the_shell_allowlist_still_runs_plain_commands(layer: Layer, monkeypatch) -> None:
    run, mark = new_run(), f"pwned-{uuid.uuid4().hex[:6]}"
    shell_setup(layer, run, mark)
    os.unlink(os.path.join(run, ".git", "config"))
    assert layer.ok(builtins.shell, run=run, command="git init -q .", sandbox_root=run)["exit_code"] == 0
    with open(os.path.join(run, ".gitconfig"), "w") as f:  # HOME is the run's folder: ignored
        f.write(f"[core]\n\tfsmonitor = touch {mark}\n[alias]\n\tst = !touch {mark}\n")
    policy = SandboxPolicy(allowed_commands=["find", "sed", "tar", "awk", "git", "env"])
    plain = {"find . -name notes.txt": "./notes.txt\n", "sed -n 's/hello/bye/p' notes.txt": "bye\n",
             "tar -tf a.tar": "notes.txt\n", "awk '{ print $1 }' notes.txt": "hello\n"}  # fmt: skip
    for line, stdout in plain.items():
        out = layer.ok(builtins.shell, run=run, command=line, sandbox_root=run, policy=policy)
        assert out["stdout"] == stdout, (line, out)
    out = layer.ok(builtins.shell, run=run, command="git status --short", sandbox_root=run, policy=policy)
    assert out["exit_code"] == 0 and "notes.txt" in out["stdout"], out
    error = layer.fails(builtins.shell, run=run, command=f"git config core.fsmonitor 'touch {mark}'",
                        sandbox_root=run, policy=policy)  # fmt: skip
    assert error.startswith("CommandRefused") and "git config" in error
    assert not os.path.exists(os.path.join(run, mark))
    # The operator's opt-in (TOOLOOP_SHELL_EXECUTORS) lets a run's allowlist use env.
    monkeypatch.setattr(sandbox.env, "_shell_executors", lambda: ["env"])
    out = layer.ok(builtins.shell, run=run, command=f"env touch {mark}", sandbox_root=run, policy=policy)
    assert out["exit_code"] == 0 and os.path.exists(os.path.join(run, mark))


# -- refusals before any tool code runs ------------------------------------------------------------
def test_strict_tools_must_be_importable() -> None:
    ctx = SandboxContext(new_run(), 5, SandboxPolicy(), strict=True, mode="basic", sandbox_root=runs_root())
    outcome = run_call(lambda: 1, {}, ctx)
    assert not outcome.ok and "module-level functions" in (outcome.error or "")


def test_bwrap_mode_refuses_calls_when_bwrap_is_missing(monkeypatch) -> None:
    missing = sandbox.Host(root=IS_ROOT, proc_children=True, bwrap_error="pretend: not installed")
    for module in (sandbox.host, sandbox.plan):  # layers() and the choice of layer
        monkeypatch.setattr(module, "_host", lambda probe: missing)
    outcome = Layer("bwrap", "bwrap", True).call(hostile.identity)
    assert not outcome.ok and "pretend: not installed" in (outcome.error or "")
    assert Layer("exec", "auto", True).call(hostile.identity).ok  # auto falls back to exec
    assert layers("auto")["bwrap"] is False


def test_an_unknown_mode_is_refused() -> None:
    outcome = Layer("fork", "sandboxy", False).call(hostile.identity)
    assert not outcome.ok and "TOOLOOP_SANDBOX='sandboxy'" in (outcome.error or "")


# -- end to end: real workers, auto and basic ----------------------------------------------------
@pytest.fixture(scope="module", params=["auto", "basic"])
def sbx(request: pytest.FixtureRequest, model_server: Any) -> Iterator[SimpleNamespace]:
    mode = request.param
    prefix = f"sbx-{mode}-{uuid.uuid4().hex[:6]}"
    env = {"TOOLOOP_KEY_PREFIX": prefix, "TOOLOOP_SANDBOX": mode}
    worker = WorkerProcess(f"sbx-{mode}-{uuid.uuid4().hex[:4]}", "-c", "2", "--tools",
                           "tests.hostile_tools", env=env)  # fmt: skip
    client = Client(settings=Settings(key_prefix=prefix, sandbox=mode))
    try:
        worker.wait_ready(client.store)
        yield SimpleNamespace(client=client, worker=worker, mode=mode, prefix=prefix)
    finally:
        worker.stop()


def tool_call(name: str, **arguments: Any) -> dict:
    return {"name": name, "arguments": arguments}


def records(result: Any) -> dict[str, Any]:
    return {r.tool_name: r for r in result.tool_calls}


def test_e2e_hostile_calls_are_contained_and_the_run_goes_on(sbx, spec) -> None:
    mark = marker()
    steps = [
        {"tool_calls": [
            tool_call("write_file", path="notes.txt", content="hello"),
            tool_call("read_file", path="../../../../etc/shadow"),
            tool_call("shell", command="cat /etc/shadow; env; echo uid=$(id -u)"),
            tool_call("environment"),
            tool_call("use_inherited_sockets"),
            tool_call("allocate", gib=6),
        ]},
        {"tool_calls": [
            tool_call("read_file", path="notes.txt"),
            tool_call("list_dir"),
            tool_call("escape", marker=mark, wait=0.2),
            tool_call("add", a=2, b=3),
        ]},
        {"content": "done"},
    ]  # fmt: skip
    names = ["write_file", "read_file", "shell", "environment", "use_inherited_sockets", "allocate",
             "list_dir", "escape", "add"]  # fmt: skip
    result = sbx.client.submit(spec(steps, tools=names, tool_timeout_s=30)).wait(timeout=90)
    assert result.status == "completed", result
    first = {r.tool_name: r for r in result.tool_calls if r.iteration == 1}
    later = {r.tool_name: r for r in result.tool_calls if r.iteration == 2}
    assert first["write_file"].output == 5
    assert first["read_file"].error.startswith("PathEscape")
    shell = first["shell"].output
    assert "Permission denied" in shell["stderr"] or "No such file" in shell["stderr"], shell
    assert "sk-test" not in shell["stdout"] and "test-secret" not in shell["stdout"]
    if IS_ROOT:
        assert int(shell["stdout"].rsplit("uid=", 1)[1]) >= sandbox.UID_BASE
    assert "sk-test" not in json.dumps(first["environment"].output)
    assert first["use_inherited_sockets"].output == []  # the pool process holds Redis sockets
    assert first["allocate"].error.startswith(("MemoryError", "Killed"))
    assert later["read_file"].output == "hello"
    assert [n for n in later["list_dir"].output if n != ".tmp/"] == ["notes.txt"]
    assert later["escape"].success and later["add"].output == 5
    assert gone(lambda: alive(mark))


@needs_root
def test_e2e_fork_bombs_are_bounded_and_the_worker_keeps_serving(sbx, spec) -> None:
    steps = [
        {"tool_calls": [
            tool_call("shell", command="f() { f | f & }; f; sleep 2; echo after"),
            tool_call("fork_bomb", limit=5000, seconds=60),
        ]},
        {"tool_calls": [tool_call("add", a=2, b=3)]},
        {"content": "done"},
    ]  # fmt: skip
    s = spec(steps, tools=["shell", "fork_bomb", "add"], tool_timeout_s=20, sandbox={"max_processes": 32})
    result = sbx.client.submit(s).wait(timeout=90)
    assert result.status == "completed", result
    calls = records(result)
    assert calls["fork_bomb"].success and calls["fork_bomb"].output["forks"] < 32
    assert gone(lambda: of_uid(calls["fork_bomb"].output["uid"]))
    assert calls["add"].output == 5 and sbx.worker.proc.poll() is None


def test_e2e_a_tool_ignoring_sigterm_is_cut_at_its_limit(sbx, spec) -> None:
    mark = marker()
    steps = [{"tool_calls": [tool_call("ignore_sigterm", marker=mark, seconds=120)]},
             {"tool_calls": [tool_call("add", a=1, b=1)]}, {"content": "done"}]  # fmt: skip
    result = sbx.client.submit(spec(steps, tools=["ignore_sigterm", "add"], tool_timeout_s=2)).wait(60)
    calls = records(result)
    assert calls["ignore_sigterm"].error.startswith("Timeout")
    assert calls["ignore_sigterm"].duration_ms < 5000 and calls["add"].output == 2
    assert gone(lambda: alive(mark))


def test_e2e_abort_kills_the_running_call(sbx, spec) -> None:
    mark = marker()
    steps = [{"tool_calls": [tool_call("escape", marker=mark, wait=120)]}, {"content": "never"}]
    run = sbx.client.submit(spec(steps, tools=["escape"], tool_timeout_s=120))
    deadline = time.monotonic() + 30
    while not alive(mark):
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.05)
    run.abort()
    assert run.wait(timeout=30).status == "aborted"
    assert gone(lambda: alive(mark), within=5)


def test_e2e_network_is_cut_for_strict_tools(sbx, spec) -> None:
    if not ((sbx.mode == "auto" and BWRAP) or (LANDLOCK_NET and SECCOMP)):
        pytest.skip(f"neither bubblewrap nor Landlock+seccomp here: {NO_BWRAP}; {KERNEL}")
    port = REDIS.port or 6379
    probe = f"bash -c 'echo PING > /dev/tcp/{REDIS.hostname}/{port}' && echo connected"
    steps = [{"tool_calls": [tool_call("shell", command=probe),
                             tool_call("connect_strict", host=REDIS.hostname, port=port)]},
             {"content": "done"}]  # fmt: skip
    result = sbx.client.submit(spec(steps, tools=["shell", "connect_strict"])).wait(timeout=60)
    calls = records(result)
    shell = calls["shell"].output
    assert "connected" not in shell["stdout"], shell
    assert "Permission denied" in shell["stderr"] or "unreachable" in shell["stderr"], shell  # it ran
    error = calls["connect_strict"].error or ""
    assert error.startswith(NETWORK_CUT), error  # the tool ran; its connect was refused


def test_e2e_doctor_tells_which_layers_are_on(sbx) -> None:
    env = {**os.environ, "TOOLOOP_KEY_PREFIX": sbx.prefix}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "doctor", "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    workers = json.loads(proc.stdout)["workers"]
    tools = next(w for name, w in workers.items() if name.startswith("tools@"))
    assert tools["sandbox"]["bwrap"] is (sbx.mode == "auto" and BWRAP)
    assert tools["sandbox"]["setuid"] is IS_ROOT and tools["sandbox"]["rlimits"] is True
    for layer in ("landlock", "landlock_net", "seccomp"):  # live, or off with the reason
        assert tools["sandbox"][layer] is (not KERNEL[layer])
        assert tools["sandbox_off"].get(layer, "") == KERNEL[layer]
    if sbx.mode == "basic":
        assert tools["sandbox_off"]["bwrap"] == "not probed: TOOLOOP_SANDBOX=basic"
    plain = subprocess.run([sys.executable, "-m", "orchestrator.cli", "doctor"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60, check=False).stdout  # fmt: skip
    assert "landlock" in plain and "seccomp" in plain
    assert ("bwrap off" in plain) is not tools["sandbox"]["bwrap"]  # basic, or no namespaces here
    from orchestrator.doctor import sandbox_report  # what /api/health shows

    health = sandbox_report(sbx.client.store)
    live = next(w for name, w in health.items() if name.startswith("tools@"))
    assert ("seccomp" in live["live"]) is SECCOMP and ("landlock" in live["live"]) is LANDLOCK


@needs_root
def test_the_folder_of_all_runs_cannot_be_listed(tmp_path: Path) -> None:
    for folder in (tmp_path.parent.parent, tmp_path.parent, tmp_path):  # searchable, as /tmp is
        folder.chmod(folder.stat().st_mode | 0o001)
    root = tmp_path / "runs"
    root.mkdir(mode=0o755)  # as `mkdir -p` in an image makes it
    ctx = SandboxContext(str(root / "r1"), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic")
    assert run_call(hostile.identity, {}, ctx).ok
    assert oct(root.stat().st_mode & 0o777) == "0o711"
    ctx.workdir = str(root / "r2")
    assert run_call(hostile.list_path, {"path": str(root / "r1")}, ctx).error.startswith("PermissionError")
    error = run_call(hostile.list_path, {"path": str(root)}, ctx).error
    assert error.startswith("PermissionError"), error


@needs_root
def test_a_sandbox_root_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    os.chown(root, 12345, 12345)  # e.g. /tmp/tooloop made first by a local user
    ctx = SandboxContext(str(root / "r1"), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic")
    outcome = run_call(hostile.identity, {}, ctx)
    assert not outcome.ok and "belongs to uid 12345" in (outcome.error or "")


def _idle_spares(worker: WorkerProcess) -> list[int]:
    """The waiting spare processes (and kept ones): children of the fork server the tools
    pool's main process started (worker/sandbox/zygote.py), below the worker's launcher."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    tools = {int(pid): int(ppid) for pid, ppid, args in rows if f"tools@{worker.name}" in args}
    main = [pid for pid, ppid in tools.items() if ppid == worker.proc.pid]
    servers = [int(pid) for pid, ppid, args in rows if int(ppid) in main and "sandbox fork server" in args]
    return [int(pid) for pid, ppid, _ in rows if int(ppid) in servers]


def test_e2e_a_runs_calls_share_its_process_two_runs_never_do(sbx, spec) -> None:
    """A process may serve several calls of one run, one at a time (worker/sandbox/reuse.py):
    4 calls over 2 pool processes take at most 2 processes; each process keeps one uid of
    its own; two runs never share a process or a uid. A spare or kept process killed from
    outside only costs the next call a fresh one."""
    steps = [{"tool_calls": [tool_call("identity")]}] * 4 + [{"content": "done"}]
    handles = [sbx.client.submit(spec(steps, tools=["identity"])) for _ in range(2)]
    seen = [[r.output for r in handle.wait(timeout=60).tool_calls] for handle in handles]
    pids = [{o["pid"] for o in run} for run in seen]
    assert not pids[0] & pids[1], pids
    if IS_ROOT:
        assert all(len(run_pids) <= 2 for run_pids in pids), pids  # the pool has 2 processes
        uids = [{o["uid"] for o in run} for run in seen]
        assert not uids[0] & uids[1] and all(u >= sandbox.UID_BASE for run in uids for u in run)
        assert all(len({(o["pid"], o["uid"]) for o in run}) == len({o["pid"] for o in run}) for run in seen)
    spares = _idle_spares(sbx.worker)
    assert spares, "no spare waiting after calls on a fork layer"
    for pid in spares:
        os.kill(pid, 9)
    again = sbx.client.submit(spec(steps, tools=["identity"])).wait(timeout=60)
    assert again.status == "completed" and all(r.success for r in again.tool_calls)


# -- issue 15: run folders only inside the operator's roots ---------------------------------------
def allow_root() -> str:
    return os.environ["TOOLOOP_SANDBOX_ALLOW"]


def submit_unchecked(client: Client, spec_data: dict, run_id: str | None = None) -> Any:
    """What a producer with Redis access can do: write and enqueue a run, skipping submit's checks."""
    from orchestrator.models import RunSpec
    from orchestrator.prompt import initial_messages
    from worker.app import enqueue_turn

    run_spec = RunSpec.model_validate(spec_data)
    run_id = run_id or uuid.uuid4().hex
    gen = client.store.create(run_id, run_spec, initial_messages(run_spec))
    enqueue_turn(run_id, 1, gen, client.celery)
    return client.get(run_id)


def victim_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A root-owned 0700 folder holding a 0600 file: what a hostile spec points the sandbox at."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    secret = victim / "secret.txt"
    secret.write_text("root only")
    secret.chmod(0o600)
    return victim, secret


def unchanged(folder: Path, secret: Path) -> None:
    st, sst = folder.stat(), secret.stat()
    assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == ("0o700", os.getuid(), os.getgid())
    assert (oct(sst.st_mode & 0o7777), sst.st_uid, sst.st_gid) == ("0o600", os.getuid(), os.getgid())
    assert secret.read_text() == "root only" and sorted(os.listdir(folder)) == ["secret.txt"]


def test_submit_refuses_a_sandbox_root_outside_the_roots(client, worker, spec, tmp_path: Path) -> None:
    victim, secret = victim_folder(tmp_path)
    link = Path(runs_root(), f"link-{uuid.uuid4().hex[:6]}")
    link.symlink_to(victim)  # inside the sandbox root by name, outside once resolved
    before = len(client.list())
    steps = [{"tool_calls": [tool_call("write_file", path="secret.txt", content="pwned")]}, {"content": "x"}]
    for given in (str(victim), str(link), "/etc", runs_root(), allow_root(), "relative/path"):
        with pytest.raises(SpecError) as refused:
            client.submit(spec(steps, tools=["write_file"], context={"sandbox_root": given}))
        assert "context.sandbox_root" in str(refused.value), given
    assert len(client.list()) == before  # nothing written
    unchanged(victim, secret)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec(steps, tools=["write_file"], context={"sandbox_root": str(victim)})))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(spec_file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 2 and "context.sandbox_root" in proc.stderr, proc
    inside_allowed = os.path.join(allow_root(), f"proj-{uuid.uuid4().hex[:6]}")
    ok = client.submit(spec([{"content": "x"}], context={"sandbox_root": inside_allowed})).wait(timeout=60)
    assert ok.status == "completed"


def test_a_run_folder_under_the_sandbox_root_is_accepted_only_with_its_run_id(client, worker, spec) -> None:
    """Failed before: `$TOOLOOP_SANDBOX_ROOT/<name>` was accepted at submit, then the worker
    refused it to the run (its id is not <name>): every tool call failed."""
    name = f"named-{uuid.uuid4().hex[:8]}"
    given = os.path.join(runs_root(), name)
    steps = [{"tool_calls": [tool_call("append_line", text="mine")]}, {"content": "done"}]
    data = spec(steps, tools=["append_line"], context={"sandbox_root": given}, tenant=name)
    for run_id in (None, f"other-{name}"):
        with pytest.raises(SpecError) as refused:
            client.submit(data, run_id=run_id)
        assert "context.sandbox_root" in str(refused.value) and f"run_id={name!r}" in str(refused.value)
    assert client.list(tenant=name) == []  # nothing written
    result = client.submit(data, run_id=name).wait(timeout=60)  # the run the folder is named after
    assert records(result)["append_line"].output == 1 and result.status == "completed"
    assert Path(given, "effects.txt").read_text() == "mine\n"


def test_the_worker_refuses_a_foreign_sandbox_root_before_touching_it(client, worker, spec,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    victim, secret = victim_folder(tmp_path)
    steps = [{"tool_calls": [tool_call("write_file", path="secret.txt", content="pwned"),
                             tool_call("append_line", text="x")]}, {"content": "done"}]  # fmt: skip
    data = spec(steps, tools=["write_file", "append_line"], context={"sandbox_root": str(victim)})
    result = submit_unchecked(client, data).wait(timeout=60)
    calls = records(result)
    for name in ("write_file", "append_line"):  # both ran into the worker's check, not into the tool
        error = calls[name].error or ""
        assert error.startswith("SandboxError") and "outside the sandbox roots" in error, error
    unchanged(victim, secret)


def test_a_folder_of_another_run_is_refused(client, worker, spec) -> None:
    first = os.path.join(allow_root(), f"proj-{uuid.uuid4().hex[:6]}")
    steps = [{"tool_calls": [tool_call("append_line", text="mine")]}, {"content": "done"}]
    owner = client.submit(spec(steps, tools=["append_line"], context={"sandbox_root": first})).wait(60)
    assert records(owner)["append_line"].output == 1
    steps = [{"tool_calls": [tool_call("append_line", text="theirs")]}, {"content": "done"}]
    for given in [os.path.join(runs_root(), owner.run_id), *([first] if IS_ROOT else [])]:
        other = submit_unchecked(client, spec(steps, tools=["append_line"],
                                              context={"sandbox_root": given})).wait(timeout=60)  # fmt: skip
        error = records(other)["append_line"].error or ""
        assert error.startswith("SandboxError") and "another run" in error, (given, error)
    assert Path(first, "effects.txt").read_text() == "mine\n"


def test_the_worker_accepts_only_a_direct_child_of_the_sandbox_root(tmp_path: Path) -> None:
    """Hole 3, the worker's own defence: run ids like ``../victim`` or absolute paths."""
    victim, secret = victim_folder(tmp_path)
    root = tmp_path / "runs"
    root.mkdir()
    nested = root / "a" / "b"
    attempts = [("../victim", root / ".." / "victim"), (str(victim), victim), ("a/b", nested),
                ("ok", root / "ok" / "deeper"), ("other", root / "mine")]
    for run_id, workdir in attempts:
        ctx = SandboxContext(str(workdir), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic",
                             run_id=run_id, allow=())  # fmt: skip
        kwargs = {"path": "secret.txt", "content": "x", "sandbox_root": str(workdir)}
        outcome = run_call(builtins.write_file, kwargs, ctx)
        assert not outcome.ok and (outcome.error or "").startswith("SandboxError: run folder refused"), run_id
    unchanged(victim, secret)
    assert sorted(os.listdir(root)) == []  # nothing created, not even an intermediate folder


@needs_root
def test_nothing_above_an_allowed_root_is_changed(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    outer.mkdir(mode=0o700)
    allowed = outer / "allowed"
    allowed.mkdir(mode=0o700)
    folder = allowed / "proj" / "run"
    ctx = SandboxContext(str(folder), 5, SandboxPolicy(), sandbox_root=runs_root(), mode="basic",
                         run_id="r1", allow=(str(allowed),))  # fmt: skip
    assert run_call(hostile.append_text, {"name": "a.txt", "text": "x"}, ctx).output == "x"
    assert oct(outer.stat().st_mode & 0o777) == "0o700" and oct(tmp_path.stat().st_mode & 0o777) == "0o700"
    assert oct(folder.stat().st_mode & 0o7777) == "0o2770" and folder.stat().st_gid != 0
    assert allowed.stat().st_gid == 0  # the allowed folder itself is the operator's: searchable, not given
    ctx.workdir = str(allowed)  # the allowed root itself is never a run's folder
    assert "run folder refused" in (run_call(hostile.identity, {}, ctx).error or "")


@needs_root
def test_a_wrapped_group_counter_skips_groups_in_use(tmp_path: Path, monkeypatch) -> None:
    """Item 7: after 16.7 M runs the counter wraps; an old folder keeping its group is not shared."""
    state = tmp_path / "state"
    monkeypatch.setattr(sandbox.folders, "STATE_DIR", str(state))
    sandbox.folders._state_dir.cache_clear()
    root = tmp_path / "runs"
    old = root / "old"
    old.mkdir(parents=True)
    try:
        ctx = SandboxContext(str(old), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic", run_id="old")
        assert run_call(hostile.identity, {}, ctx).ok
        old_gid = old.stat().st_gid
        assert old_gid == sandbox.constants.GID_BASE + 1
        (state / "gid-counter").write_text(f"{sandbox.constants.GID_SPAN}\n")  # the last group: wraps next
        new = SandboxContext(str(root / "new"), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic",
                             run_id="new")  # fmt: skip
        assert run_call(hostile.identity, {}, new).ok
        assert (root / "new").stat().st_gid == old_gid + 1  # group 1 skipped: still in use by "old"
        # An old folder whose group was handed to another run since is refused, not taken as is.
        (state / "groups" / "1").write_text(json.dumps({"run": "newer", "folder": "/elsewhere"}))
        sandbox.folders._prepared.clear()
        outcome = run_call(hostile.identity, {}, ctx)
        assert "belongs to another run" in (outcome.error or ""), outcome
    finally:
        sandbox.folders._state_dir.cache_clear()
        sandbox.folders._prepared.clear()


@needs_root
def test_a_group_counter_that_went_back_goes_past_the_groups_in_use(tmp_path: Path, monkeypatch) -> None:
    """A worker killed between the old counter's truncate and its write left it empty: the
    next runs took groups from 1 again, climbed through the freed ones and, behind more
    than MAX_GID_PROBES groups in use, every new run failed 'no free run group' (seen on
    this host after a chaos bench: 14,000 bench folders ahead of the counter)."""
    state = tmp_path / "state"
    monkeypatch.setattr(sandbox.folders, "STATE_DIR", str(state))
    monkeypatch.setattr(sandbox.folders, "MAX_GID_PROBES", 3)
    sandbox.folders._state_dir.cache_clear()
    root = tmp_path / "runs"
    try:
        def new_run(name: str) -> tuple[SandboxContext, Path]:
            folder = root / name
            return SandboxContext(str(folder), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic",
                                  run_id=name), folder  # fmt: skip

        gids = []
        for i in range(5):  # a row of 5 groups in use, longer than the probes allowed
            ctx, folder = new_run(f"old{i}")
            assert run_call(hostile.identity, {}, ctx).ok
            gids.append(folder.stat().st_gid)
        assert gids == [sandbox.constants.GID_BASE + n for n in range(1, 6)]
        counter = state / "gid-counter"
        assert counter.read_text().strip() == "5" and len(counter.read_bytes()) == 17  # fixed width
        for behind in ("", "0\n", "garbled"):
            counter.write_text(behind)
            ctx, folder = new_run(f"new-{len(behind)}")
            outcome = run_call(hostile.identity, {}, ctx)
            assert outcome.ok, outcome
            assert folder.stat().st_gid > max(gids)  # past the row, no group shared
            gids.append(folder.stat().st_gid)
        uids = state / "uid-counter"
        uids.write_text("garbled")  # a random block then, never the first one again
        sandbox.folders._uid_blocks.clear()
        assert sandbox.folders.next_uid(str(root)) > sandbox.constants.UID_BASE + sandbox.constants.UID_BLOCK
    finally:
        sandbox.folders._state_dir.cache_clear()
        sandbox.folders._prepared.clear()
        sandbox.folders._uid_blocks.clear()


# -- issue 12: the hostile suite inside a Docker-default-like seccomp profile ---------------------
@pytest.mark.timeout(1500)  # the suite's calls again, inside the profile
def test_the_hostile_suite_holds_under_docker_default_seccomp() -> None:
    """The third configuration: no namespaces (bwrap cannot work), so fork and exec calls
    rely on the always-layer plus Landlock and seccomp, which Docker's profile allows."""
    if not IS_ROOT:
        pytest.skip("the launcher cuts the capability bounding set as Docker does: needs root")
    launcher = [sys.executable, "-m", "tests.docker_default", "--"]
    probe = ("import json; from worker.sandbox import kernel, layers; print(json.dumps("
             "[open('/proc/self/status').read(), kernel.status(), layers('auto')]))")  # fmt: skip
    out = subprocess.run([*launcher, sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    status, kernel, inside = json.loads(out)
    assert "Seccomp:\t2" in status and "CapEff:\t00000000a80425fb" in status  # Docker's filter and caps
    assert kernel == {"landlock": "", "landlock_net": "", "seccomp": ""}, kernel
    assert not inside["bwrap"] and inside["landlock"] and inside["seccomp"], inside
    # The calls in this process, layer by layer. Runs through real workers under the profile are
    # the matrix's "docker" cells (tests/test_sandbox_matrix.py: its workers start inside the
    # profile), so none starts here (each would cost a worker's start, litellm included).
    no_workers = "not e2e and not submit_refuses and not worker_refuses and not folder_of_another_run"
    suite = [sys.executable, "-m", "pytest", "tests/test_sandbox.py", "-q", "-rs", "-p", "no:cacheprovider",
             "-k", f"not docker and {no_workers}"]  # fmt: skip
    proc = subprocess.run([*launcher, *suite], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.splitlines()[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed)", summary)}
    assert counts.get("passed", 0) >= 100 and not counts.get("failed"), tail
    assert "Creating new namespace failed: Operation not permitted" in proc.stdout, tail  # why bwrap is off
