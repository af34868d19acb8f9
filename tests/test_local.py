"""Local deployments (orchestrator/local.py): what the demo, the benches and this suite start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

from tests.conftest import ROOT
from tests.helpers import wait_for

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
    wait_for(lambda: not _alive(launcher), timeout=40)  # a warm shutdown, not a kill


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


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
