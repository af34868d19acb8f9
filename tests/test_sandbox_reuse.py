"""A process serving several calls of a run (worker/sandbox/reuse.py): when it stays, when
it goes, and that the next call finds the run's folder, environment and limits again.
Unit level: ``run_call`` in this process as the tool worker calls it (``run_id``, deferred
clean-up, ``settle()`` after each call); every containment test of test_sandbox.py also
runs in a reused process (its ``fork-reused`` layer)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from orchestrator.models import SandboxPolicy
from tests import hostile_tools as hostile
from tests.helpers import process_alive, wait_for
from tests.test_sandbox import alive, gone, marker, needs_root, runs_root
from worker import sandbox
from worker.sandbox import CallOutcome, SandboxContext, run_call, zygote

pytestmark = needs_root


def run_of(run_id: str):
    def call(fn, timeout: float = 30, **kwargs) -> CallOutcome:
        ctx = SandboxContext(os.path.join(runs_root(), run_id), timeout, SandboxPolicy(), mode="basic",
                             sandbox_root=runs_root(), run_id=run_id, defer_cleanup=True)  # fmt: skip
        try:
            return run_call(fn, kwargs, ctx)
        finally:
            sandbox.settle()

    return call


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:10]}"


def pid_of(outcome: CallOutcome) -> int:
    assert outcome.ok, outcome.error
    return outcome.output["pid"] if isinstance(outcome.output, dict) else outcome.output


def test_the_calls_of_a_run_share_a_process_and_find_their_run_as_it_was() -> None:
    run_id, other = new_run_id(), new_run_id()
    call = run_of(run_id)
    first = call(hostile.identity).output
    seen = call(hostile.wander, value="x").output
    after = call(hostile.identity).output
    again = call(hostile.wander, value="y").output
    assert first["pid"] == seen["pid"] == after["pid"] == again["pid"]  # one process
    assert first["uid"] == after["uid"] and first["limits"] == after["limits"]
    assert seen["cwd"] == after["cwd"] == again["cwd"] == first["cwd"]  # back in its folder
    assert again["env"] is None  # the environment is the allowlist again
    stranger = run_of(other)(hostile.identity).output
    assert stranger["pid"] != first["pid"] and stranger["uid"] != first["uid"]  # never two runs
    sandbox.reuse.forget(run_id)
    assert gone(lambda: [first["pid"]] if os.path.exists(f"/proc/{first['pid']}") and
                process_alive(first["pid"]) else [])  # fmt: skip


@pytest.mark.parametrize("leave", ["process", "thread", "file", "memory", "timeout"])
def test_a_call_that_leaves_something_ends_its_process(leave: str) -> None:
    """A process left behind (killed as before), a thread, an open file, 64 MiB held, a
    timeout: the next call of the run gets a fresh process."""
    run_id = new_run_id()
    call = run_of(run_id)
    first = pid_of(call(hostile.identity))
    mark = marker()
    if leave == "process":
        assert call(hostile.escape, marker=mark, wait=0.1).ok
        assert gone(lambda: alive(mark))
    elif leave == "thread":
        assert pid_of(call(hostile.leave_thread, seconds=30)) == first
    elif leave == "file":
        assert pid_of(call(hostile.leak_file, name="held.txt")) == first
    elif leave == "timeout":
        assert call(hostile.burn_cpu, seconds=5, timeout=0.5).error.startswith("Timeout")
    else:
        assert pid_of(call(hostile.hold_memory, mb=64)) == first
    assert pid_of(call(hostile.identity)) != first
    sandbox.reuse.forget(run_id)


def test_no_reuse_with_tooloop_sandbox_reuse_0(monkeypatch) -> None:
    monkeypatch.setenv("TOOLOOP_SANDBOX_REUSE", "0")
    call = run_of(new_run_id())
    assert pid_of(call(hostile.identity)) != pid_of(call(hostile.identity))


def test_an_idle_process_ends_and_the_next_call_gets_a_fresh_one(monkeypatch) -> None:
    monkeypatch.setattr(zygote, "KEEP_IDLE_S", 0.2)
    zygote.restart()  # a fork server that ends kept processes idle for 0.2 s
    try:
        run_id = new_run_id()
        call = run_of(run_id)
        first = pid_of(call(hostile.identity))
        assert sandbox.reuse.kept_pid(run_id) == first
        wait_for(lambda: sandbox.reuse.kept_pid(run_id) is None, 5)  # the server's sweep
        assert gone(lambda: [first] if process_alive(first) else [])
        assert pid_of(call(hostile.identity)) != first
        sandbox.reuse.forget(run_id)
    finally:
        monkeypatch.undo()
        zygote.restart()


def test_the_next_call_enters_its_folder_under_a_folder_its_uid_cannot_search(tmp_path) -> None:
    """Runs under a 0700 folder (a home holding the run root): the first call enters its
    folder as root, before it becomes its uid; the next call in the same process is that
    uid already and enters by the descriptor it kept (by its path: EACCES, seen when two
    calls of a run in one turn met in one process)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    root = home / "runs"
    root.mkdir(mode=0o711)
    run_id = new_run_id()
    ctx = SandboxContext(str(root / run_id), 30, SandboxPolicy(), mode="basic", sandbox_root=str(root),
                         run_id=run_id, defer_cleanup=True)  # fmt: skip
    outcomes = []
    for _ in range(2):
        outcomes.append(run_call(hostile.identity, {}, ctx))
        sandbox.settle()
    first, second = outcomes
    assert first.ok and second.ok, (first.error, second.error)
    assert first.output["pid"] == second.output["pid"]  # the same process served both
    assert second.output["cwd"] == first.output["cwd"] == os.path.realpath(root / run_id)
    sandbox.reuse.forget(run_id)


def test_a_fresh_process_holds_none_of_the_servers_descriptors_however_many_it_keeps() -> None:
    """The fork server holds two pipe ends per kept process (and a connection per pool
    process): a spare closes them all at once. Before, each was pointed at /dev/null one by
    one, in every spare: a call's process cost +3 ms of CPU with 500 kept (bench/fork_cpu.py)."""
    runs = [new_run_id() for _ in range(20)]
    for run_id in runs:  # 20 processes kept: 40 pipe ends in the server
        pid_of(run_of(run_id)(hostile.identity))
    try:
        server = zygote.for_this_process()
        assert server is not None and len(os.listdir(f"/proc/{server.pid}/fd")) > 40
        fresh = new_run_id()
        held = run_of(fresh)(hostile.inherited_fds)
        assert held.ok, held.error
        pipes = {int(fd) for fd, target in held.output.items() if target.startswith("pipe:")}
        others = {target for fd, target in held.output.items() if int(fd) > 2 and int(fd) not in pipes}
        assert pipes == {3, 4}, held.output  # its result and request pipes, nothing of the server's
        assert others <= {os.path.realpath(os.path.join(runs_root(), fresh))}, held.output  # its folder
        runs.append(fresh)
    finally:
        for run_id in runs:
            sandbox.reuse.forget(run_id)


def test_the_server_outlives_descriptor_numbers_past_1024(monkeypatch) -> None:
    """520 kept processes: the server holds ~1,045 descriptors, and the next connection (a
    pool process started again) takes a number past 1,024, where ``select.select`` raises
    ValueError: the server died, and every kept process with it. It waits with poll(2)."""
    monkeypatch.setenv("TOOLOOP_SANDBOX_REUSE", "600")
    monkeypatch.setattr(zygote, "KEEP_IDLE_S", 600.0)  # none ends idle while 520 are made (loaded: > 10 s)
    server = zygote.restart()
    runs = [new_run_id() for _ in range(520)]
    try:
        assert server is not None
        for run_id in runs:
            pid_of(run_of(run_id)(hostile.identity))
        assert len(os.listdir(f"/proc/{server.pid}/fd")) > 1040
        first = sandbox.reuse.kept_pid(runs[0])
        second = zygote.Zygote(zygote._hub)  # as a new pool process connects
        assert "identity" in second.tools  # its first request, answered
        assert server.alive() and pid_of(run_of(new_run_id())(hostile.identity))
        assert first is not None and sandbox.reuse.kept_pid(runs[0]) == first and process_alive(first)
        second.sock.close()
    finally:
        sandbox.reuse.forget()
        monkeypatch.undo()
        zygote.restart()


def test_kept_processes_fit_the_descriptor_limit() -> None:
    """Two pipe ends per kept process: under a soft and hard limit of 300 descriptors, a
    server keeps (300 - 256) / 2 = 22, not the 512 asked (which would leave no descriptor
    for a new spare's pipes); a soft limit under the hard one is raised first."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
            "from worker.sandbox.fork_server import kept_within_fd_limit as k; "
            "print(k(512), k(4))")  # fmt: skip
    for soft, hard, expected in ((300, 300, "22 4"), (300, 4096, "512 4")):
        out = subprocess.run([sys.executable, "-c", code.format(soft=soft, hard=hard)], capture_output=True,
                             text=True, check=True, timeout=60)  # fmt: skip
        assert out.stdout.split() == expected.split(), (soft, hard, out.stdout, out.stderr)
