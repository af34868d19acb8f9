"""MCP servers as tool sources: real servers written with the SDK (tests/mcp_server.py),
one over stdio (started by the worker, in the sandbox) and one over streamable HTTP on
loopback; real workers, the scripted model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.local import free_port
from orchestrator.models import Status
from tests.helpers import READY_S, call, tools, wait_for
from worker.sandbox import UID_BASE, UID_SPAN

SERVER = str(Path(__file__).with_name("mcp_server.py"))
TOKEN = "tok-" + os.urandom(4).hex()


@pytest.fixture(scope="module")
def http_server():
    """The streamable-HTTP MCP server, on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    import socket

    def up() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    # a readiness wait, not a measure of speed: a fresh interpreter importing the MCP SDK
    # took over 30 s on a box loaded 15x its cores; a server that died fails at once
    wait_for(lambda: up() or proc.poll() is not None, timeout=READY_S)
    assert proc.poll() is None, f"the MCP HTTP server exited {proc.returncode}"
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def _servers_file(folder: Path, http_server: str, **more: dict) -> str:
    config = {"mcpServers": {
        "calc": {"command": "python", "args": [SERVER], "env": {"MCP_MARKER": "hello"}},
        "web": {"url": http_server, "headers": {"X-Token": "MCP_TEST_TOKEN"}},
        **more,
    }}  # fmt: skip
    path = folder / "servers.yaml"  # YAML here; JSON in test_config_files_json_or_yaml
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _started(d):
    os.environ["MCP_TEST_TOKEN"] = TOKEN  # the worker reads it at call time, from its environment
    try:
        worker = d.start_worker("-c", "2")
    finally:
        os.environ.pop("MCP_TEST_TOKEN")
    # A server that cannot start is left out of the catalog with a warning in the worker's
    # log (e.g. a sandbox uid cannot run an interpreter under /root): say so, not KeyError.
    catalog = d.store.catalog()
    missing = [name for name in ("calc__add", "web__add") if name not in catalog]
    why = [line for line in worker.tail(1 << 20).splitlines() if "MCP" in line or "cannot start" in line]
    assert not missing, f"{missing} not in the catalog; in the worker's log {worker.log}:\n" + "\n".join(why)
    return d


@pytest.fixture
def mcp_deployment(deployment, http_server, tmp_path):
    """An MCP deployment of the test's own, for tests that stop or kill its worker."""
    return _started(deployment(TOOLOOP_MCP_SERVERS=_servers_file(tmp_path, http_server)))


MISSING = "/nonexistent/mcp-server-missing"
# a file every sandbox layer shows (bubblewrap's /tmp is empty), anyone may read, none run: EACCES
NOT_EXECUTABLE = "/etc/passwd"


@pytest.fixture(scope="module")
def mcp_shared(stack, http_server, tmp_path_factory):
    """One MCP deployment for the tests that neither stop nor kill its worker (each costs
    12-16 s to start): the servers of ``mcp_deployment``, one whose command is missing and
    one whose command may not be run."""
    from tests.conftest import Deployment

    path = _servers_file(tmp_path_factory.mktemp("mcp"), http_server, broken={"command": MISSING},
                         denied={"command": NOT_EXECUTABLE})  # fmt: skip
    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-{os.urandom(3).hex()}"
    d = Deployment(prefix, {**stack.env, "TOOLOOP_MCP_SERVERS": path})
    try:
        yield _started(d)
    finally:
        d.stop()


def _run_folder(run_id: str) -> str:
    return os.path.realpath(os.path.join(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id))


def _processes_in(folder: str) -> list[int]:
    """Processes whose working folder is ``folder`` (the run's MCP server, if any)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == folder:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_catalog_names_sources_and_schemas(mcp_shared):
    catalog = mcp_shared.store.catalog()
    add = catalog["calc__add"]
    assert add["source"] == "mcp" and add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"]["type"] == "integer"
    assert add["parameters"]["required"] == ["a", "b"]
    assert catalog["web__token_header"]["source"] == "mcp"
    assert catalog["read_file"]["source"] == "builtin" and catalog["add"]["source"] == "python"
    published = mcp_shared.store.redis.hgetall(mcp_shared.store.keys.workers())
    assert published and not any(TOKEN.encode() in value for value in published.values())  # never stored
    # `tooloop tools`, from another process
    env = {**os.environ, **mcp_shared.env}
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "tools", "--json"], env=env,
                         capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    listed = {t["name"]: t for t in json.loads(out.stdout)}
    assert listed["calc__whoami"]["source"] == "mcp" and listed["shell"]["source"] == "builtin"
    assert listed["calc__whoami"]["workers"] == [f"tools@{mcp_shared.workers[0].name}"]
    plain = subprocess.run([sys.executable, "-m", "orchestrator.cli", "tools"], env=env,
                           capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    assert any(line.split()[:2] == ["web__add", "mcp"] for line in plain.stdout.splitlines())


def test_run_calls_stdio_and_http_servers(mcp_shared, spec, model_server):
    steps = [
        tools(call("calc__add", {"a": 2, "b": 3}), call("web__add", {"a": 4, "b": 3}),
              call("calc__whoami"), call("web__token_header")),
        {"content": "done"},
    ]  # fmt: skip
    s = spec(steps, tools=["calc__add", "web__add", "calc__whoami", "web__token_header"])
    handle = mcp_shared.client.submit(s)
    result = handle.wait(timeout=90)
    assert result.status == Status.completed, result
    add, web_add, who, token = result.tool_calls
    assert (add.success, add.output, web_add.success, web_add.output) == (True, 5, True, 7)
    assert token.success and token.output == TOKEN  # header from the worker's environment
    # the stdio server ran in the sandbox: the run's folder, its own uid, allowlisted env
    assert who.success and who.output["cwd"] == _run_folder(handle.run_id)
    assert who.output["marker"] == "hello"
    assert "OPENAI_API_KEY" not in who.output["env"] and "MCP_TEST_TOKEN" not in who.output["env"]
    if os.geteuid() == 0:
        assert UID_BASE <= who.output["uid"] < UID_BASE + UID_SPAN
    # the model saw the schemas the servers published
    first = model_server.calls(s["model"])[0]
    names = {t["function"]["name"]: t["function"] for t in first["tools"]}
    assert names["calc__add"]["parameters"]["properties"]["b"]["type"] == "integer"
    assert set(names["calc__add"]) == {"name", "description", "parameters"}


def test_errors_and_a_dead_server_are_failed_records(mcp_shared, spec, model_server):
    steps = [
        tools(call("calc__fail", {"message": "nope"}), call("calc__add", {"a": "x"}),
              call("calc__protocol_error")),
        tools(call("calc__die")),
        tools(call("calc__add", {"a": 1, "b": 1})),  # the next call starts the server again
        {"content": "done"},
    ]
    s = spec(steps, tools=["calc__fail", "calc__add", "calc__die", "calc__protocol_error"])
    result = mcp_shared.client.submit(s).wait(timeout=90)
    assert result.status == Status.completed, result
    failed, invalid, protocol, died, again = result.tool_calls
    assert not failed.success and failed.error.startswith("McpToolError:")
    assert not invalid.success and "McpToolError" in invalid.error and "validation" in invalid.error
    assert not protocol.success and protocol.error == "McpError: quota exhausted"
    assert not died.success and died.error.startswith("ServerDied:")
    assert again.success and again.output == 2
    # each failure reached the model as a tool message
    second = model_server.calls(s["model"])[1]["messages"]
    errors = [m["content"][:13] for m in second if m["role"] == "tool"]
    assert errors == ["Error: McpToo", "Error: McpToo", "Error: McpErr"]


def test_one_server_process_per_run_closed_when_the_run_ends(mcp_shared, spec):
    steps = [tools(call("calc__whoami")), tools(call("calc__whoami"), call("calc__whoami")),
             {"content": "done"}]  # fmt: skip
    first = mcp_shared.client.submit(spec(steps, tools=["calc__whoami"]))
    second = mcp_shared.client.submit(spec(steps, tools=["calc__whoami"]))
    results = [first.wait(timeout=90), second.wait(timeout=90)]
    instances = [{c.output["instance"] for c in r.tool_calls} for r in results]
    assert [len(i) for i in instances] == [1, 1]  # three calls, one server process, per run
    assert instances[0] != instances[1]
    for handle in (first, second):  # closed once the run ended
        wait_for(lambda h=handle: not _processes_in(_run_folder(h.run_id)), timeout=20)


def test_time_limit_and_worker_stop_leave_no_server(mcp_deployment, spec):
    s = spec([tools(call("calc__slow", {"seconds": 60})), {"content": "done"}],
             tools=["calc__slow"], tool_timeout_s=2)  # fmt: skip
    result = mcp_deployment.client.submit(s).wait(timeout=60)
    [slow] = result.tool_calls
    assert not slow.success and slow.error.startswith("Timeout:")
    # a call in flight when the worker stops: its server does not outlive the worker
    s = spec([tools(call("calc__slow", {"seconds": 120})), {"content": "done"}], tools=["calc__slow"])
    handle = mcp_deployment.client.submit(s)
    folder = _run_folder(handle.run_id)
    wait_for(lambda: _processes_in(folder), timeout=30)
    mcp_deployment.stop()
    stopped = time.monotonic()
    wait_for(lambda: not _processes_in(folder), timeout=10)
    print(f"server gone {time.monotonic() - stopped:.2f}s after the worker")


def test_a_call_whose_worker_is_lost_is_worker_lost_not_run_again(mcp_deployment, spec, model_server):
    """kill -9 the worker mid-call: the same failed record as any non-idempotent tool's."""
    s = spec([tools(call("calc__slow", {"seconds": 120})), {"content": "ok"}], tools=["calc__slow"])
    handle = mcp_deployment.client.submit(s)
    folder = _run_folder(handle.run_id)
    wait_for(lambda: _processes_in(folder), timeout=30)  # the server runs the call
    mcp_deployment.start_worker("-c", "2")
    mcp_deployment.workers[0].kill()
    result = handle.wait(timeout=60)
    assert (result.status, result.content) == (Status.completed, "ok")
    [record] = result.tool_calls
    assert not record.success and record.error.startswith("WorkerLost"), record
    assert "outcome is unknown" in record.error
    fed_back = model_server.calls(s["model"])[1]["messages"][-1]["content"]
    assert fed_back.startswith("Error: WorkerLost")
    assert len(model_server.calls(s["model"])) == 2  # one call, not run again


def test_http_header_values_are_read_at_each_request(monkeypatch):
    """A header's value comes from the environment when a request is sent, not when the
    session opened: a rotated token is used by the next request, an unset one is not sent."""
    import httpx2

    from worker.sources.mcp_host import EnvHeaders

    auth = EnvHeaders({"X-Token": "MCP_UNIT_TOKEN"})
    seen: list[str | None] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.headers.get("X-Token"))
        return httpx2.Response(200)

    async def requests() -> None:  # one client for all three, as one session keeps
        async with httpx2.AsyncClient(auth=auth, transport=httpx2.MockTransport(answer)) as http:
            for value in ("first", "second", None):
                if value is None:
                    monkeypatch.delenv("MCP_UNIT_TOKEN")
                else:
                    monkeypatch.setenv("MCP_UNIT_TOKEN", value)
                await http.post("http://127.0.0.1/mcp")

    asyncio.run(requests())
    assert seen == ["first", "second", None]
    assert "first" not in repr(vars(auth)) and "second" not in repr(vars(auth))  # never kept


def test_host_opens_one_session_per_run_and_keeps_no_lock(monkeypatch):
    """Concurrent first calls share one session; the lock that makes them goes once no call
    holds or awaits it, whether the open worked, failed or was cut short (no growth per run)."""
    from worker.sources import mcp_host
    from worker.sources.mcp_config import McpServer

    opened: list[str] = []

    async def open_(self, request, timeout_s):  # a server that takes a while to start
        opened.append(self.run_id)
        await asyncio.sleep(0.2)
        if request.get("fail"):
            raise RuntimeError("cannot start")
        self.client = object()

    monkeypatch.setattr(mcp_host.Session, "open", open_)
    host = mcp_host.Host([McpServer("calc", command="python")])
    server = host.servers["calc"]

    async def calls() -> None:
        first = [host._session(server, ("calc", "r1"), {"timeout_s": 5}) for _ in range(3)]
        assert len({id(session) for session in await asyncio.gather(*first)}) == 1
        with pytest.raises(RuntimeError):
            await host._session(server, ("calc", "r2"), {"timeout_s": 5, "fail": True})
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(host._session(server, ("calc", "r3"), {"timeout_s": 5}), 0.05)
        assert opened == ["r1", "r2", "r3"] and list(host.sessions) == [("calc", "r1")]
        assert host.opening == {}
        await host.drop_run("r1")
        assert host.sessions == {} and host.opening == {}

    asyncio.run(calls())


def test_config_files_json_or_yaml(tmp_path):
    from worker.sources.mcp_config import McpConfigError, load_servers, tool_name

    config = {"mcpServers": {"files": {"command": "python", "args": ["-m", "srv"], "env": {"A": "1"}},
                             "web": {"url": "https://h.test/mcp", "headers": {"Authorization": "WEB_TOKEN"}}}}
    for name, text in (("s.json", json.dumps(config)), ("s.yaml", yaml.safe_dump(config))):
        (tmp_path / name).write_text(text)
        files, web = load_servers(str(tmp_path / name))
        assert (files.stdio, files.command, files.args) == (True, "python", ("-m", "srv"))
        assert files.env == {"A": "1"} and (web.stdio, web.url) == (False, "https://h.test/mcp")
        assert web.headers == {"Authorization": "WEB_TOKEN"}  # a variable's name, never its value
    bad = {
        "both": ({"x": {"command": "a", "url": "http://h/"}}, "either `command`"),
        "header": ({"x": {"url": "http://h/", "headers": {"A": "Bearer abc"}}}, "name environment variables"),
        "scheme": ({"x": {"url": "ftp://h/"}}, "http:// or https://"),
        "name": ({"a__b": {"command": "a"}}, "no '__'"),
        "field": ({"x": {"command": "a", "cwd": "/"}}, "unknown field"),
    }
    for case, (servers, why) in bad.items():
        (tmp_path / f"{case}.json").write_text(json.dumps({"mcpServers": servers}))
        with pytest.raises(McpConfigError, match=why):
            load_servers(str(tmp_path / f"{case}.json"))
    (tmp_path / "broken.yaml").write_text("mcpServers: [")
    with pytest.raises(McpConfigError, match="not valid YAML"):
        load_servers(str(tmp_path / "broken.yaml"))
    assert tool_name("calc", "add") == "calc__add" and tool_name("calc", "read.file") is None


def _processes_under(prefix: str) -> list[int]:
    """Processes whose working folder's path starts with ``prefix`` (also once it is removed)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/cwd").removesuffix(" (deleted)").startswith(prefix):
                    found.append(int(entry))
    return found


async def _until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def test_a_server_that_never_finishes_its_handshake_leaves_no_task_or_process(monkeypatch):
    """A stdio "server" that never answers the handshake (``sleep``), in the host, in the
    sandbox: a call to it and the catalog listing both end at their bound, and afterwards
    the host's event loop runs no task but the caller and no process of the server is
    left (counted by working folder: the run's, and the catalog's)."""
    import uuid

    from worker.sources import mcp_host
    from worker.sources.mcp_config import McpServer

    monkeypatch.setattr(mcp_host, "LIST_TIMEOUT_S", 2.5)  # room for the sandbox to start it, under load
    host = mcp_host.Host([McpServer("stall", command="sleep", args=("600",))])
    root = os.environ["TOOLOOP_SANDBOX_ROOT"]
    run_id = f"stall-{uuid.uuid4().hex[:8]}"
    folder = os.path.realpath(os.path.join(root, run_id))
    request = {"server": "stall", "tool": "anything", "arguments": {}, "run_id": run_id,
               "workdir": folder, "sandbox_root": root, "timeout_s": 2.5}  # fmt: skip
    counts: dict[str, object] = {}

    async def scenario() -> None:
        this = asyncio.current_task()
        call = asyncio.create_task(host.call(request))
        counts["started"] = await _until(lambda: _processes_in(folder), 30)  # it really ran
        counts["reply"] = await call
        counts["tasks"] = [t for t in asyncio.all_tasks() if t is not this]
        counts["processes"] = await _until(lambda: not _processes_in(folder), 10) or _processes_in(folder)
        catalog_started = time.monotonic()
        counts["catalog"] = await host.catalog(root)
        counts["catalog_s"] = time.monotonic() - catalog_started
        counts["catalog_tasks"] = [t for t in asyncio.all_tasks() if t is not this]
        listed = os.path.join(os.path.realpath(root), mcp_host.CATALOG_FOLDER)
        counts["catalog_processes"] = await _until(lambda: not _processes_under(listed), 10) or (
            _processes_under(listed))  # fmt: skip
        counts["sessions"] = dict(host.sessions)

    try:
        asyncio.run(scenario())
    finally:  # what the old code left behind, while the loop lived, is gone now anyway
        for pid in _processes_in(folder):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
    assert counts["started"] is True
    reply = counts["reply"]
    assert not reply["ok"] and reply["error"].startswith("Timeout:"), reply
    assert counts["tasks"] == [] and counts["processes"] is True, counts
    [error] = counts["catalog"]["errors"]
    assert error.startswith("MCP server 'stall': cannot list its tools: ") and "handshake" in error
    assert counts["catalog_tasks"] == [] and counts["catalog_processes"] is True, counts
    assert counts["sessions"] == {} and counts["catalog_s"] < 15


def test_a_malformed_servers_file_refuses_to_start_the_worker(tmp_path):
    """`mcpServer:` for `mcpServers:`: the tool worker exits 2 with one line naming the file
    and the key, before it says ready (it used to start, serve nothing and say ready),
    whether started as `tooloop worker` or as `celery -A worker.app worker`."""
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"mcpServer": {"calc": {"command": "python", "args": [SERVER]}}}))
    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-{os.urandom(3).hex()}"
    env = {**os.environ, "TOOLOOP_MCP_SERVERS": str(path), "TOOLOOP_KEY_PREFIX": prefix}
    commands = {
        "tooloop": [sys.executable, "-m", "orchestrator.cli", "worker", "-Q", "tools", "-c", "1",
                    "-n", prefix],
        "celery": [sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q", f"{prefix}.tools",
                   "-P", "prefork", "-c", "1", "-n", f"tools@{prefix}", "--without-mingle"],
    }  # fmt: skip
    for how, command in commands.items():
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            _, stderr = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # still running: the zombie this test is about
            os.killpg(proc.pid, 9)
            _, stderr = proc.communicate()
            raise AssertionError(f"{how}: the worker did not refuse to start:\n{stderr[-3000:]}") from None
        lines = [line for line in stderr.splitlines() if str(path) in line]
        assert proc.returncode == 2, (how, proc.returncode, stderr[-3000:])
        assert lines and "mcpServers" in lines[0] and "mcpServer`" in lines[0], (how, stderr[-3000:])
        assert "ready" not in stderr, how


def test_a_reply_over_the_cap_is_a_failed_record(mcp_shared, spec):
    """A result past a forked call's cap (16 MiB) is `OutputTooLarge`, as a forked call's
    is; the host and the pool read what comes in linear time, and the server's next call
    works (the session that carried it was closed, the next one starts the server again)."""
    steps = [tools(call("calc__big", {"mib": 17})),
             tools(call("calc__big", {"mib": 1}), call("calc__add", {"a": 1, "b": 2})),
             {"content": "done"}]  # fmt: skip
    started = time.monotonic()
    result = mcp_shared.client.submit(spec(steps, tools=["calc__big", "calc__add"])).wait(timeout=120)
    over, under, after = result.tool_calls
    assert not over.success and over.error == "OutputTooLarge: the tool's output exceeds 16 MiB", over.error
    assert under.success and under.output.startswith("x" * 1000)  # the record keeps its first chars
    assert (after.success, after.output) == (True, 3)
    print(f"17 MiB refused, 1 MiB read, in {time.monotonic() - started:.1f}s")


def test_stdio_servers_get_the_shells_git_settings(mcp_shared, spec):
    """A repository made by a call (its own uid) is read by git in an MCP server (another
    uid): no "dubious ownership" (`safe.directory`), and the shell's other git settings."""
    made = ("git init -q . && git -c safe.directory='*' -c user.name=t -c user.email=t@t.test"
            " commit -q --allow-empty -m first && id -u")  # each call its own uid: git wants it declared
    steps = [tools(call("shell", {"command": made})),
             tools(call("calc__git", {"args": ["log", "--format=%s"]}),
                   call("calc__git", {"args": ["config", "--get", "core.hooksPath"]}), call("calc__whoami")),
             {"content": "done"}]  # fmt: skip
    handle = mcp_shared.client.submit(spec(steps, tools=["shell", "calc__git", "calc__whoami"]))
    shell, log, hooks, who = handle.wait(timeout=90).tool_calls
    assert shell.success and shell.output["exit_code"] == 0, shell
    if os.geteuid() == 0:  # the repository's owner is not the server's uid: the case git refuses
        assert int(shell.output["stdout"]) != who.output["uid"]
    assert log.success and log.output == {"code": 0, "stdout": "first\n", "stderr": ""}, log
    assert hooks.output["stdout"] == "/dev/null\n"  # hooks written into .git/hooks never run


def test_an_unstartable_server_is_reported_with_its_cause(mcp_shared):
    """A server whose command is missing (ENOENT) or may not be run (EACCES): the worker's
    log says why on the line that names it, and `tooloop doctor` and `tooloop tools` show
    it with that cause."""
    worker = mcp_shared.workers[0]
    log = worker.tail(1 << 20).splitlines()
    for server, cause in (("broken", "No such file or directory"), ("denied", "Permission denied")):
        [line] = [line for line in log if f"MCP server '{server}'" in line]
        assert "cannot list its tools" in line and cause in line, line
    env = {**os.environ, **mcp_shared.env}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    report = json.loads(cli("doctor", "--json").stdout)
    unavailable = report["workers"][f"tools@{worker.name}"]["mcp_unavailable"]
    assert sorted(unavailable) == ["broken", "denied"], unavailable
    assert "No such file or directory" in unavailable["broken"] and MISSING in unavailable["broken"]
    assert "Permission denied" in unavailable["denied"], unavailable["denied"]
    doctor, listed = cli("doctor"), cli("tools")

    def shown(text: str) -> bool:
        lines = text.splitlines()
        return any("broken" in line and "No such file" in line for line in lines) and any(
            "denied" in line and "Permission denied" in line for line in lines
        )

    assert shown(doctor.stdout), doctor.stdout
    assert listed.returncode == 0 and "calc__add" in listed.stdout and shown(listed.stderr), listed.stderr


def test_a_server_that_cannot_start_says_why(monkeypatch, capsys):
    """Issue 29: a stdio server that dies at start, or whose sandbox cannot be made (here a
    mount bubblewrap cannot make), fails the call with what it said on stderr (bubblewrap's
    own message), not with the SDK's "Connection closed" alone; the worker's log (the host's
    stderr) has that message once."""
    import uuid

    from worker import sandbox
    from worker.sources import mcp_host
    from worker.sources.mcp_config import McpServer

    marker = f"cannot-start-{uuid.uuid4().hex[:8]}"
    host = mcp_host.Host([McpServer("dies", command="sh", args=("-c", f"echo {marker} >&2; exit 3"))])
    runs = os.environ["TOOLOOP_SANDBOX_ROOT"]

    def first_call(mode: str) -> str:
        run_id = f"r-{uuid.uuid4().hex[:8]}"
        request = {"server": "dies", "run_id": run_id, "tool": "x", "arguments": {}, "timeout_s": 30,
                   "workdir": os.path.join(runs, run_id), "sandbox_root": runs, "mode": mode}  # fmt: skip
        answer = asyncio.run(host.call(request))
        assert not answer["ok"], answer
        return answer["error"]

    error = first_call("basic")
    assert error.startswith("McpError") and marker in error, error
    logged = capsys.readouterr().err  # the host's stderr: the worker's log
    assert logged.count(marker) == 1, logged  # the server's own line, once
    if not sandbox.layers("bwrap")["bwrap"]:
        pytest.skip("bubblewrap does not work here: " + sandbox.host._host(probe=True).bwrap_error)
    missing = f"/nonexistent-{uuid.uuid4().hex[:6]}"
    bwrap_argv = sandbox.command._bwrap_argv

    def broken(*args):  # a mount bubblewrap cannot make
        return [*bwrap_argv(*args), "--ro-bind", missing, "/x"]

    monkeypatch.setattr(sandbox.command, "_bwrap_argv", broken)
    error = first_call("bwrap")
    assert f"bwrap: Can't find source path {missing}" in error, error
    logged = capsys.readouterr().err
    assert logged.count(f"Can't find source path {missing}") == 1, logged
