"""The sandbox, attacked the way a hostile model would (issue 5).

Unit level: ``run_call`` in this process, under each layer:
- ``fork``: TOOLOOP_SANDBOX=basic, a default ``@tool`` (the always-layer alone);
- ``exec``: TOOLOOP_SANDBOX=basic, a strict tool (always-layer, fresh interpreter);
- ``bwrap``: TOOLOOP_SANDBOX=bwrap (every call in bubblewrap).
End to end: real workers (one ``auto``, one ``basic``), each with its own key prefix,
driven by the scripted model.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest

from orchestrator import Client
from orchestrator.models import SandboxPolicy
from orchestrator.settings import Settings
from tests import hostile_tools as hostile
from tests.conftest import ROOT, WorkerProcess
from worker import builtins, sandbox
from worker.sandbox import CallOutcome, SandboxContext, layers, run_call

BWRAP = layers("auto")["bwrap"]
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

    @property
    def bwrap(self) -> bool:
        return self.name == "bwrap"

    def call(self, fn: Callable[..., Any], run: str | None = None, timeout: float = 30,
             policy: SandboxPolicy | None = None, on_tick: Callable[[], bool] | None = None,
             **kwargs: Any) -> CallOutcome:  # fmt: skip
        ctx = SandboxContext(
            workdir=run or new_run(), timeout_s=timeout, policy=policy or SandboxPolicy(),
            on_tick=on_tick or (lambda: True), strict=self.strict, mode=self.mode,
            sandbox_root=runs_root(),
        )  # fmt: skip
        return run_call(fn, kwargs, ctx)

    def ok(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        outcome = self.call(fn, **kwargs)
        assert outcome.ok, outcome.error
        return outcome.output

    def fails(self, fn: Callable[..., Any], **kwargs: Any) -> str:
        outcome = self.call(fn, **kwargs)
        assert not outcome.ok, f"{self.name}: the attempt succeeded: {outcome.output!r}"
        assert outcome.error
        return outcome.error


@pytest.fixture(params=[("fork", "basic", False), ("exec", "basic", True), ("bwrap", "bwrap", True)],
                ids=["fork", "exec", "bwrap"])  # fmt: skip
def layer(request: pytest.FixtureRequest) -> Layer:
    name, mode, strict = request.param
    if name == "bwrap" and not BWRAP:
        pytest.skip(NO_BWRAP)
    return Layer(name, mode, strict)


@pytest.fixture
def bwrap_layer() -> Layer:
    if not BWRAP:
        pytest.skip(NO_BWRAP)
    return Layer("bwrap", "bwrap", True)


# -- the run folder works ---------------------------------------------------------------
def test_the_run_folder_works_and_is_shared_by_the_calls_of_a_run(layer: Layer) -> None:
    run = new_run()
    assert layer.ok(hostile.append_text, run=run, name="log.txt", text="one ") == "one "
    assert layer.ok(hostile.append_text, run=run, name="log.txt", text="two") == "one two"
    assert layer.ok(builtins.write_file, run=run, path="sub/a.txt", content="héllo", sandbox_root=run) == 5
    assert layer.ok(builtins.read_file, run=run, path="sub/a.txt", sandbox_root=run) == "héllo"
    assert layer.ok(builtins.list_dir, run=run, sandbox_root=run) == ["log.txt", "sub/"]
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
        assert limits["RLIMIT_NOFILE"] == [256, 256] and limits["RLIMIT_FSIZE"][0] == 256 << 20
    assert first["uid"] != second["uid"]


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
    if IS_ROOT or layer.bwrap:  # not root and no bwrap: the call is the worker's user, who owns it
        layer.call(hostile.write_path, path=sibling, text="x")  # under bwrap: into a tmpfs, maybe
        assert not os.path.exists(sibling)
    assert layer.ok(hostile.write_path, path="inside.txt", text="x") == "written"


def test_other_runs_folders_are_out_of_reach(layer: Layer) -> None:
    if not (IS_ROOT or layer.bwrap):
        pytest.skip("a non-root worker without bwrap runs every call as its own user")
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
def test_the_environment_holds_no_secret(layer: Layer) -> None:
    assert os.environ["OPENAI_API_KEY"] == "sk-test"  # what a leak would show
    assert os.environ["TOOLOOP_SECRET_KEY"] == "test-secret"
    env = layer.ok(hostile.environment)
    assert "OPENAI_API_KEY" not in env and not any(k.startswith("TOOLOOP_") for k in env)
    assert not any(s in v for v in env.values() for s in ("sk-test", "test-secret")), env
    block = layer.call(hostile.proc_environ)
    assert not block.ok or ("sk-test" not in block.output and "test-secret" not in block.output)
    shell = layer.ok(builtins.shell, command="env", sandbox_root=(run := new_run()), run=run)
    assert "sk-test" not in shell["stdout"] and "TOOLOOP_SECRET_KEY" not in shell["stdout"]
    assert "PATH=" in shell["stdout"]


def test_inherited_connections_are_closed(layer: Layer) -> None:
    with socket.create_connection((REDIS.hostname, REDIS.port or 6379)) as redis:
        redis.sendall(b"PING\r\n")
        assert redis.recv(64) == b"+PONG\r\n"  # a live Redis connection, for the call to inherit
        assert layer.ok(hostile.use_inherited_sockets) == []
        fds = layer.ok(hostile.inherited_fds)
    assert not [t for t in fds.values() if t.startswith("socket:")], fds


def test_no_network_under_bwrap(bwrap_layer: Layer) -> None:
    port = REDIS.port or 6379
    bwrap_layer.fails(hostile.connect, host=REDIS.hostname, port=port)
    allowed = SandboxPolicy(network=True)  # the control: the same call, network allowed
    assert bwrap_layer.ok(hostile.connect, host=REDIS.hostname, port=port, policy=allowed) == "+PONG\r\n"
    run = new_run()
    probe = f"bash -c 'echo PING > /dev/tcp/{REDIS.hostname}/{port}' && echo connected"
    out = bwrap_layer.ok(builtins.shell, run=run, command=probe, sandbox_root=run)
    assert out["exit_code"] != 0 and "connected" not in out["stdout"]


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


def test_file_size_is_limited(layer: Layer) -> None:
    error = layer.fails(hostile.big_file, mb=3, policy=SandboxPolicy(max_file_mb=1))
    assert "File too large" in error, error


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
    listing = layer.ok(builtins.list_dir, run=run, sandbox_root=run)
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
    assert later["read_file"].output == "hello" and later["list_dir"].output == ["notes.txt"]
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
    if sbx.mode == "basic":
        pytest.skip("TOOLOOP_SANDBOX=basic: no network namespace, by design (docs/sandbox.md)")
    if not BWRAP:
        pytest.skip(NO_BWRAP)
    port = REDIS.port or 6379
    probe = f"bash -c 'echo PING > /dev/tcp/{REDIS.hostname}/{port}' && echo connected"
    steps = [{"tool_calls": [tool_call("shell", command=probe),
                             tool_call("connect_strict", host=REDIS.hostname, port=port)]},
             {"content": "done"}]  # fmt: skip
    result = sbx.client.submit(spec(steps, tools=["shell", "connect_strict"])).wait(timeout=60)
    calls = records(result)
    assert "connected" not in calls["shell"].output["stdout"]
    assert not calls["connect_strict"].success


def test_e2e_doctor_tells_which_layers_are_on(sbx) -> None:
    env = {**os.environ, "TOOLOOP_KEY_PREFIX": sbx.prefix}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "doctor", "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    workers = json.loads(proc.stdout)["workers"]
    tools = next(w for name, w in workers.items() if name.startswith("tools@"))
    assert tools["sandbox"]["bwrap"] is (sbx.mode == "auto" and BWRAP)
    assert tools["sandbox"]["setuid"] is IS_ROOT and tools["sandbox"]["rlimits"] is True


@needs_root
def test_the_folder_of_all_runs_cannot_be_listed(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir(mode=0o755)  # as `mkdir -p` in an image makes it
    layer = Layer("fork", "basic", False)
    ctx = SandboxContext(str(root / "r1"), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic")
    assert run_call(hostile.identity, {}, ctx).ok
    assert oct(root.stat().st_mode & 0o777) == "0o711"
    error = layer.fails(hostile.list_path, path=str(root), run=str(root / "r2"))
    assert error.startswith("PermissionError")


@needs_root
def test_a_sandbox_root_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    os.chown(root, 12345, 12345)  # e.g. /tmp/tooloop made first by a local user
    ctx = SandboxContext(str(root / "r1"), 5, SandboxPolicy(), sandbox_root=str(root), mode="basic")
    assert sandbox.prepare_workdir(ctx.workdir, str(root)) == ctx.workdir  # never raises
    outcome = run_call(hostile.identity, {}, ctx)
    assert not outcome.ok and "belongs to uid 12345" in (outcome.error or "")


def _idle_spares(worker: WorkerProcess) -> list[int]:
    """The waiting spare processes: forks of the tool pool's processes (same command line),
    one level below the pool processes, below the tools worker's main process."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    tools = {int(pid): int(ppid) for pid, ppid, args in rows if f"tools@{worker.name}" in args}
    main = [pid for pid, ppid in tools.items() if ppid == worker.proc.pid]
    pool = [pid for pid, ppid in tools.items() if ppid in main]
    return [pid for pid, ppid in tools.items() if ppid in pool]


def test_e2e_each_call_gets_a_fresh_process_even_from_a_spare(sbx, spec) -> None:
    """Spares take the fork off the hot path; still one process (and uid) per call, and a
    spare killed from outside only costs the next call an on-demand fork."""
    steps = [{"tool_calls": [tool_call("identity")]}] * 3 + [{"content": "done"}]
    result = sbx.client.submit(spec(steps, tools=["identity"])).wait(timeout=60)
    seen = [r.output for r in result.tool_calls]
    assert len({o["pid"] for o in seen}) == 3
    if IS_ROOT:
        assert len({o["uid"] for o in seen}) == 3 and all(o["uid"] >= sandbox.UID_BASE for o in seen)
    spares = _idle_spares(sbx.worker)
    assert spares, "no spare waiting after calls on a fork layer"
    for pid in spares:
        os.kill(pid, 9)
    again = sbx.client.submit(spec(steps, tools=["identity"])).wait(timeout=60)
    assert again.status == "completed" and all(r.success for r in again.tool_calls)
