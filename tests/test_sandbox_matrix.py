"""The sandbox matrix (issue 29): every layer, every kind of run folder, every kind of tool.
In every cell the calls run and prove it, and the layer's containment holds on calls that
ran (a call that could not start is not "contained": it fails the cell).

- layers: ``bwrap`` (``TOOLOOP_SANDBOX=bwrap``: strict calls and MCP servers in bubblewrap),
  ``basic`` (fork and exec layers with Landlock and seccomp), and ``docker`` (``auto``
  inside Docker's default seccomp profile and capabilities, ``tests/docker_default.py``:
  namespaces are refused there, so bubblewrap cannot work and ``auto`` falls back to exec);
- folders: a run's default folder (``$TOOLOOP_SANDBOX_ROOT/<run_id>``) and a spec's own
  (``context.sandbox_root`` under an allowed root outside /tmp, made by another user, as a
  checkout is), each on a root worker and on a worker that is not root
  (``tests/nonroot.py``: then every call is the worker's user);
- tools: the ``shell`` built-in, ``write_file``/``read_file``, a ``@tool(sandbox="strict")``
  function and an MCP stdio server's tool (the last two run ``tests/sandbox_probe.py``).

A cell is one run, so one test per (layer, user) holds two runs at once, one per folder,
each the other's neighbour: turn 1 writes its files; turn 2 (once both runs' files are
there) reads them back and makes every attempt (writes outside its folder, reads the other
run's secret, TCP to Redis and the broker, the environment, 768 MiB under a 512 MiB limit).
Cost: one worker per (layer, user), all started at once for the module (~2.5 min at load 17
on this 2-core box: litellm, Celery and the MCP host each); a cell ~18 s there.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from orchestrator import Client
from orchestrator.local import WorkerProcess
from orchestrator.settings import Settings
from tests.conftest import ROOT
from tests.helpers import call, tools, wait_for
from worker import sandbox
from worker.sandbox.paths import _reachable_by_others

IS_ROOT = os.geteuid() == 0
KERNEL = sandbox.kernel.status()
LANDLOCK = not KERNEL["landlock"]  # (status(): each layer's reason when off, "" when on)
SERVER = str(Path(__file__).with_name("mcp_server.py"))
WORKER_UID = 0x5D00_0000 + random.randint(1, 1 << 20)  # the worker that is not root
CHECKOUT_UID = 0x5E00_0000 + random.randint(1, 1 << 20)  # whoever made a spec's folder
MEMORY_MB, ALLOCATE_MB = 512, 768
REDIS = urlparse(os.environ["TOOLOOP_REDIS_URL"])
# What the call may see of the worker's environment, and what the shell or bubblewrap set.
ALLOWED_ENV = {"PATH", "HOME", "TMPDIR", "TMP", "TEMP", "TEMPDIR", "LANG", "TERM",
               *sandbox.constants.ENV_PASSTHROUGH, "PWD", "OLDPWD", "SHLVL", "_"}  # fmt: skip
# In the workers' environment, never in a call's.
SECRETS = {name: f"{name.lower()}-{uuid.uuid4().hex[:12]}"
           for name in ("REDIS_PASSWORD", "ANTHROPIC_API_KEY", "AWS_SECRET_ACCESS_KEY")}
LAYERS = ("bwrap", "basic", "docker")
USERS = ("root", "nonroot")


@dataclass
class Cell:
    layer: str
    user: str
    client: Client
    worker: WorkerProcess
    sandbox_root: str
    allow_root: str
    owner: int  # who made a spec's folder (a checkout's user; the worker itself when not root)
    mcp_env: dict[str, str] = field(default_factory=dict)  # what the MCP server's config adds
    net_cut: str = ""  # what refuses a call's TCP, of the worker's live layers ("": nothing)
    net_open: str = ""  # else why not, as the worker says it (doctor)

    @property
    def worker_env(self) -> dict[str, str]:
        """The worker's environment (this process's, plus what the cell gave it)."""
        return {**os.environ, **SECRETS, "TOOLOOP_KEY_PREFIX": self.client.settings.key_prefix}


def _skip_reason(layer: str, user: str) -> str | None:
    if layer == "bwrap" and not sandbox.layers()["bwrap"]:  # (TOOLOOP_SANDBOX=basic turns it off too)
        return f"bubblewrap is off for this session: {sandbox.layer_reasons()['bwrap']}"
    if user == "root" and not IS_ROOT:
        return "the tests run as a user that is not root: no root worker here"
    if layer == "docker" and not IS_ROOT:
        return "tests/docker_default.py cuts the capability bounding set as Docker does: needs root"
    return None


def _mcp_python() -> tuple[str, dict[str, str]] | str:
    """A Python every call's uid can run with the MCP SDK importable (pyenv's, under /root,
    is unreadable outside bubblewrap): this one where others can reach it, else the
    system's with this environment's packages on PYTHONPATH. Or why there is none."""
    import mcp

    packages = str(Path(mcp.__file__).resolve().parent.parent)
    if _reachable_by_others(os.path.realpath(sys.executable)) and _reachable_by_others(packages):
        return sys.executable, {}
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is None or not _reachable_by_others(packages):
        return f"no Python that sandbox uids can run imports mcp ({sys.executable} is not reachable)"
    env = {"PYTHONPATH": packages}
    check = [system, "-c", "import mcp.server.mcpserver"]
    proc = subprocess.run(check, env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60, user=WORKER_UID if IS_ROOT else None, check=False)  # fmt: skip
    if proc.returncode != 0:
        return f"{system} cannot import mcp from {packages}: {proc.stderr.strip()[-300:]}"
    return system, env


def _owned_folder(prefix: str, uid: int, under: str | None = None) -> str:
    folder = tempfile.mkdtemp(prefix=prefix, dir=under)
    os.chmod(folder, 0o755)
    if IS_ROOT:
        os.chown(folder, uid, uid)
    return folder


def _start(layer: str, user: str, base: str, mcp: tuple[str, dict[str, str]]) -> Cell:
    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-mx-{layer}-{user}-{uuid.uuid4().hex[:4]}"
    nonroot = user == "nonroot"
    owner = WORKER_UID if nonroot and IS_ROOT else os.geteuid()
    runs = os.environ["TOOLOOP_SANDBOX_ROOT"]
    if nonroot:  # its own: the worker's user makes the run folders in it
        runs = _owned_folder(f"runs-{layer}-{user}-", owner, base)
    allow = _owned_folder(f"tooloop-allow-{layer}-{user}-", owner, "/var/tmp")  # outside bwrap's private /tmp
    python, mcp_env = mcp
    config = Path(base, f"mcp-{layer}-{user}.json")
    server = {"command": python, "args": [SERVER], "env": mcp_env}
    config.write_text(json.dumps({"mcpServers": {"calc": server}}))
    mode = {"bwrap": "bwrap", "basic": "basic", "docker": "auto"}[layer]  # (docker: auto finds no bwrap)
    env = {**SECRETS, "TOOLOOP_KEY_PREFIX": prefix, "TOOLOOP_SANDBOX": mode, "TOOLOOP_SANDBOX_ROOT": runs,
           "TOOLOOP_SANDBOX_ALLOW": allow, "TOOLOOP_MCP_SERVERS": str(config)}  # fmt: skip
    wrap: list[str] = []
    if nonroot and IS_ROOT:
        wrap = [sys.executable, "-m", "tests.nonroot", "--uid", str(WORKER_UID),
                *(["--docker-default"] if layer == "docker" else []), "--"]  # fmt: skip
        env["HOME"] = "/nonexistent"
    elif layer == "docker":
        wrap = [sys.executable, "-m", "tests.docker_default", "--"]
    name = f"mx-{layer}-{user}-{uuid.uuid4().hex[:4]}"
    args = ("-c", "3", "--tools", "tests.hostile_tools")
    worker = WorkerProcess(name, *args, env=env, cwd=str(ROOT), wrap=wrap)
    client = Client(settings=Settings(key_prefix=prefix, sandbox_root=runs, sandbox_allow=allow))
    return Cell(layer, user, client, worker, runs, allow, CHECKOUT_UID if not nonroot else owner, mcp_env)


@pytest.fixture(scope="module")
def cells(request: pytest.FixtureRequest, model_server: Any) -> Iterator[dict[tuple[str, str], Cell | str]]:
    """A worker per (layer, user) this session runs (``-k`` may pick a few) that can run
    here, all started together; else why not."""
    base = tempfile.mkdtemp(prefix="tooloop-matrix-")
    os.chmod(base, 0o755)
    mcp = _mcp_python()
    out: dict[tuple[str, str], Cell | str] = {}
    for layer, user in _selected(request.session):
        why = _skip_reason(layer, user) or (mcp if isinstance(mcp, str) else None)
        out[layer, user] = why or _start(layer, user, base, mcp)  # type: ignore[arg-type]
    try:
        for key, cell in out.items():
            if isinstance(cell, Cell):
                out[key] = _ready(cell)
        yield out
    finally:
        started = [cell for cell in out.values() if isinstance(cell, Cell)]
        for cell in started:  # all at once: each takes seconds to shut down warm
            cell.worker.proc.terminate()
        for cell in started:
            cell.worker.stop()
            shutil.rmtree(cell.allow_root, ignore_errors=True)
            if cell.sandbox_root != os.environ["TOOLOOP_SANDBOX_ROOT"]:
                shutil.rmtree(cell.sandbox_root, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _selected(session: pytest.Session) -> list[tuple[str, str]]:
    """The (layer, user) cells among the session's tests."""
    ours = [item for item in session.items if getattr(item, "module", None) is sys.modules[__name__]]
    params = [getattr(item, "callspec", None) for item in ours]
    return sorted({(p.params["layer"], p.params["user"]) for p in params if p is not None})


def _ready(cell: Cell) -> Cell | str:
    """The worker, ready, with the layer it was started for; else why this host cannot."""
    try:
        cell.worker.wait_ready(cell.client.store, timeout=240)
    except RuntimeError:
        if cell.worker.proc.returncode == 3:  # tests/nonroot.py could not make its namespace
            return f"no worker that is not root here: {cell.worker.tail(600).strip()}"
        raise
    from orchestrator.doctor import sandbox_report

    live = next(w for name, w in sandbox_report(cell.client.store).items() if name.startswith("tools@"))
    if cell.layer == "bwrap" and "bwrap" not in live["live"]:  # (unprivileged namespaces may be off)
        cell.worker.stop()
        return f"bubblewrap does not work for this worker: {live['off'].get('bwrap')}"
    assert ("bwrap" in live["live"]) is (cell.layer == "bwrap"), live  # docker: namespaces refused
    assert ("setuid" in live["live"]) is (cell.user == "root"), live
    # Without network a call's TCP is refused by bwrap's empty net namespace, else by Landlock's
    # TCP rules or seccomp's socket rule, either alone (docs/sandbox.md); a kernel with neither
    # leaves it open, and doctor must say why: that cell's network check cannot apply.
    cell.net_cut = ", ".join(layer for layer in ("netns", "landlock_net", "seccomp") if layer in live["live"])
    if not cell.net_cut:
        off = live["off"]
        assert off.get("landlock_net") and off.get("seccomp"), live
        cell.net_open = f"Landlock TCP rules: {off['landlock_net']}; seccomp: {off['seccomp']}"
    return cell


def _given_folder(cell: Cell) -> str:
    """A spec's own folder: a checkout under the allowed root, made by its owner (not root)."""
    checkout = Path(cell.allow_root, f"checkout-{uuid.uuid4().hex[:6]}")
    folder = checkout / "repo"
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("from the checkout\n")
    if IS_ROOT:
        for path in (checkout, folder, folder / "README.md"):
            os.chown(path, cell.owner, cell.owner)
    return str(folder)


def _targets(cell: Cell, mine: str, theirs: str, tag: str) -> dict[str, Any]:
    outside = [f"/etc/tooloop-pwned-{tag}", os.path.join(cell.sandbox_root, f"pwned-{tag}"),
               os.path.join(cell.allow_root, f"pwned-{tag}"), f"/tmp/tooloop-pwned-{tag}",
               os.path.join(theirs, f"planted-{tag}")]  # fmt: skip
    return {"token": f"token-{tag}", "outside": outside, "neighbours": [os.path.join(theirs, "secret.txt")],
            "network": [[REDIS.hostname, REDIS.port or 6379], ["127.0.0.1", 5672]],
            "allocate_mb": ALLOCATE_MB}  # fmt: skip


def _shell_probe(targets: dict[str, Any]) -> str:
    """The same attempts from ``shell``, each one saying it was made ("refused X")."""
    lines = ['echo "ran as $(id -u) in $(pwd)"']
    for path in targets["outside"]:
        lines.append(f'(echo pwned > "{path}") 2>/dev/null && echo "ESCAPED wrote {path}" '
                     f'|| echo "refused {path}"')  # fmt: skip
    for path in targets["neighbours"]:
        lines.append(f'cat "{path}" 2>/dev/null && echo "ESCAPED read {path}" || echo "refused {path}"')
    for host, port in targets["network"]:
        lines.append(f"bash -c 'exec 3<>/dev/tcp/{host}/{port}' 2>/dev/null "
                     f"&& echo 'ESCAPED connected {host}:{port}' || echo 'refused {host}:{port}'")
    lines.append(f"python3 -c 'print(6 * 7); bytearray({targets['allocate_mb']} << 20)'")
    lines.append("echo '--- env'; env")
    return "\n".join(lines)


def _steps(cell: Cell, folder: str, other: str, tag: str, given: bool) -> list:
    """Turn 1 writes the run's files; turn 2, once the other run's are there too, attacks."""
    targets = _targets(cell, folder, other, tag)
    second = [call("read_file", {"path": "notes.txt"}), call("shell", {"command": _shell_probe(targets)}),
              call("probe_strict", {"targets": targets}), call("calc__probe", {"targets": targets}),
              call("read_file", {"path": os.path.join(other, "secret.txt")}),
              call("write_file", {"path": f"../escape-{tag}.txt", "content": "x"})]  # fmt: skip
    if given:
        second.append(call("read_file", {"path": "README.md"}))
    both = [os.path.join(folder, "secret.txt"), os.path.join(other, "secret.txt")]

    def attack(request: dict) -> dict:
        # (the other run's turn 1 failed: its record says why; within the model call's 120 s)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: all(os.path.exists(p) for p in both), timeout=60)
        return tools(*second)

    return [tools(call("write_file", {"path": "secret.txt", "content": f"secret-{tag}"}),
                  call("write_file", {"path": "notes.txt", "content": f"notes-{tag}"})),
            attack, {"content": "done"}]  # fmt: skip


@pytest.mark.timeout(900)  # the module's workers start in the first test's setup (~2.5 min at load 17)
@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("layer", LAYERS)
def test_every_tool_runs_and_is_contained(cells, model_server, layer: str, user: str) -> None:
    cell = cells[layer, user]
    if isinstance(cell, str):
        pytest.skip(cell)
    default_id, tag_a, tag_b = f"mx-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    default, given = os.path.join(os.path.realpath(cell.sandbox_root), default_id), _given_folder(cell)
    names = ["write_file", "read_file", "shell", "probe_strict", "calc__probe"]
    runs = {}
    pairs = ((default, given, tag_a, {}), (given, default, tag_b, {"sandbox_root": given}))
    for folder, other, tag, context in pairs:
        model = model_server.script(_steps(cell, folder, other, tag, given=bool(context)))
        spec = {"prompt": "probe", "model": model, "model_params": {"api_base": model_server.api_base},
                "tools": names, "tool_timeout_s": 120, "sandbox": {"memory_mb": MEMORY_MB},
                **({"context": context} if context else {})}  # fmt: skip
        runs[folder] = (cell.client.submit(spec, run_id=default_id if not context else None), other, tag)
    results = {folder: handle.wait(timeout=300) for folder, (handle, _, _) in runs.items()}
    wheres = {default: f"{layer}/{user}/default folder", given: f"{layer}/{user}/given folder"}
    for folder, result in results.items():  # first: did each run's files get written (turn 1)?
        assert result.status == "completed", (wheres[folder], result)
        failed = [r.error for r in result.tool_calls if r.iteration == 1 and not r.success]
        assert failed == [], (wheres[folder], failed)
    for folder, (_, other, tag) in runs.items():
        _check_cell(cell, wheres[folder], results[folder], folder, other, tag, folder == given)
    if not cell.net_cut:  # said in the session's report, not passed over in silence
        message = f"{layer}/{user}: nothing cuts a call's network here ({cell.net_open}): not checked"
        warnings.warn(message, pytest.PytestWarning, stacklevel=1)


def _check_cell(cell: Cell, where: str, result: Any, folder: str, other: str, tag: str, given: bool) -> None:
    targets = _targets(cell, folder, other, tag)
    first = [r for r in result.tool_calls if r.iteration == 1]
    assert sorted(r.output for r in first) == sorted([len(f"secret-{tag}"), len(f"notes-{tag}")]), where
    by_name: dict[str, list[Any]] = {}
    for r in result.tool_calls:
        if r.iteration == 2:
            by_name.setdefault(r.tool_name, []).append(r)
    # write_file / read_file: written, read back; the checkout's own file; escapes refused by the tool
    reads = {r.inputs["path"]: r for r in by_name["read_file"]}
    assert reads["notes.txt"].output == f"notes-{tag}", (where, reads["notes.txt"])
    assert reads[os.path.join(other, "secret.txt")].error.startswith("PathEscape"), where
    assert by_name["write_file"][0].error.startswith("PathEscape"), (where, by_name["write_file"])
    if given:
        assert reads["README.md"].output == "from the checkout\n", (where, reads["README.md"])
    _check_shell(cell, where, by_name["shell"][0], folder, targets)
    for name in ("probe_strict", "calc__probe"):
        record = by_name[name][0]
        assert record.success, (where, name, record.error)  # it ran (a call that could not start fails here)
        _check_probe(cell, f"{where}/{name}", record.output, folder, targets, mcp=name == "calc__probe")
    for path in targets["outside"]:
        assert not os.path.exists(path), (where, "written outside the folder", path)
    assert Path(other, "secret.txt").read_text().startswith("secret-"), where


def _check_shell(cell: Cell, where: str, record: Any, folder: str, targets: dict[str, Any]) -> None:
    assert record.success, (where, record.error)
    out = record.output
    stdout, env_text = out["stdout"].split("--- env\n", 1)
    lines = stdout.splitlines()
    assert out["exit_code"] == 0 and lines[0].endswith(f" in {folder}"), (where, out)
    for path in targets["outside"]:  # (bwrap: a write to /tmp lands in its private /tmp)
        assert f"refused {path}" in lines or not _must_refuse(cell, path), (where, path, stdout)
    for path in targets["neighbours"]:
        assert f"refused {path}" in lines, (where, path, stdout)
    if cell.net_cut:
        assert not [line for line in lines if line.startswith("ESCAPED connected")], (where, stdout)
        assert all(f"refused {h}:{p}" in lines for h, p in targets["network"]), (where, stdout)
    assert "42" in lines and "MemoryError" in out["stderr"], (where, out)  # its python3 ran, and was capped
    names = [line.split("=", 1)[0] for line in env_text.splitlines() if "=" in line]
    _check_env(cell, where, names, env_text)


def _check_probe(cell: Cell, where: str, out: dict[str, Any], folder: str, targets: dict[str, Any],
                 mcp: bool) -> None:  # fmt: skip
    assert out["cwd"] == folder and out["wrote"] == targets["token"], (where, out["cwd"])
    if cell.user == "root":
        assert sandbox.UID_BASE <= out["uid"] < sandbox.UID_BASE + sandbox.UID_SPAN, (where, out["uid"])
    else:
        assert out["uid"] == (WORKER_UID if IS_ROOT else os.geteuid()), (where, out["uid"])
    for path, outcome in out["outside"].items():
        assert not outcome.startswith("ok") or not _must_refuse(cell, path), (where, path, outcome)
    for path, outcome in out["neighbours"].items():
        assert not outcome.startswith("ok"), (where, path, outcome)
    if cell.net_cut:
        assert not [o for o in out["network"].values() if o.startswith("ok")], (where, out["network"])
    assert out["memory"].startswith("MemoryError"), (where, out["memory"])
    added = set(cell.mcp_env) if mcp else set()  # what the server's config sets
    _check_env(cell, where, list(out["env"]), json.dumps(out["env"]), allowed=added)


def _must_refuse(cell: Cell, path: str) -> bool:
    """Which writes outside the folder this layer refuses *in the call* (under bwrap a write
    to /tmp lands in its private /tmp: it never reaches the host, which the test checks)."""
    if cell.layer == "bwrap":
        return not path.startswith("/tmp/")
    if LANDLOCK:
        return True
    return cell.user == "root" and not path.startswith("/tmp/")  # the uid alone: not world-writable places


def _check_env(cell: Cell, where: str, names: list[str], text: str, allowed: set[str] | None = None) -> None:
    """No variable of the worker's environment beyond the allowlist, no secret value."""
    foreign = (set(names) & set(cell.worker_env)) - ALLOWED_ENV - (allowed or set())
    assert not foreign, (where, sorted(foreign))
    values = [*SECRETS.values(), os.environ["TOOLOOP_SECRET_KEY"], os.environ["OPENAI_API_KEY"]]
    assert not [v for v in values if v in text], (where, "a secret reached the call")
