"""Declared HTTP tools against a local HTTP server: calls, templates, limits, and every
refusal (a host outside allow_hosts, a redirect out of it, a metadata address, the
worker's variables sent where the operator did not allow)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from orchestrator import SpecError
from orchestrator.http_tools import HttpTool
from orchestrator.models import Status
from orchestrator.settings import Settings
from tests.helpers import call, tools, wait_for
from worker.sources.http_tools import Refused, check_target

SECRET = "k-" + "7" * 12


class _Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True
    seen: list[dict] = []

    def log_message(self, *_: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        seen = {"method": self.command, "path": url.path, "query": parse_qs(url.query),
                "auth": self.headers.get("Authorization"), "body": body,
                "host": self.headers.get("Host")}  # fmt: skip
        _Handler.seen.append(seen)
        if url.path == "/redirect":
            self._reply(302, b"", Location=parse_qs(url.query)["to"][0])
        elif url.path == "/big":
            self._reply(200, b"x" * 5000, "text/plain")
        elif url.path == "/trickle":  # a byte every 0.2 s: no read timeout ever fires
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the client gave up: expected
                return
        elif url.path == "/missing":
            self._reply(404, b'{"error": "no such item"}')
        else:
            self._reply(200, json.dumps(seen).encode(), X_Served_By="test")

    do_GET = do_POST = do_PUT = _handle


@pytest.fixture(scope="module")
def site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _tool(site: str, **fields: object) -> dict:
    base = {
        "name": "get_item", "description": "Read one item.",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}, "q": {"type": "string"}},
                       "required": ["id"]},
        "url": f"http://{site}/items/{{id}}?q={{q}}", "allow_hosts": [site],
    }  # fmt: skip
    return {**base, **fields}


def test_calls_with_templates_bounds_and_failures(client, worker, spec, site, model_server):
    post = _tool(site, name="post_item", method="POST", url=f"http://{site}/echo",
                 body={"id": "{id}", "label": "item {id}: {q}", "fixed": [1, True]},
                 headers={"X-Trace": "t-{id}"})  # fmt: skip
    big = _tool(site, name="big", url=f"http://{site}/big", max_response_bytes=1000)
    missing = _tool(site, name="missing", url=f"http://{site}/missing")
    steps = [
        tools(call("get_item", {"id": 7, "q": "a b/c"}), call("post_item", {"id": 3, "q": "x"}),
              call("big", {"id": 1}), call("missing", {"id": 1}), call("get_item", {"id": "seven"})),
        {"content": "done"},
    ]  # fmt: skip
    s = spec(steps, http_tools=[_tool(site), post, big, missing])
    result = client.submit(s).wait(timeout=60)
    assert result.status == Status.completed, result
    got, posted, large, absent, invalid = result.tool_calls
    assert got.success and got.output["status"] == 200
    assert got.output["body"]["path"] == "/items/7" and got.output["body"]["query"] == {"q": ["a b/c"]}
    assert got.output["headers"]["x-served-by"] == "test" and got.output["truncated"] is False
    sent = json.loads(posted.output["body"]["body"])
    assert sent == {"id": 3, "label": "item 3: x", "fixed": [1, True]}  # "{id}" kept its JSON type
    assert large.output["truncated"] is True and large.output["body"] == "x" * 1000
    assert absent.success and absent.output["status"] == 404
    assert not invalid.success and invalid.error.startswith("ValidationError: id:")
    # declared tools reach the model with their schemas, without being listed in `tools`
    offered = {t["function"]["name"] for t in model_server.calls(s["model"])[0]["tools"]}
    assert offered == {"get_item", "post_item", "big", "missing"}


def test_a_redirect_out_of_allow_hosts_is_refused(client, worker, spec, site):
    _Handler.seen.clear()
    port = site.split(":")[1]
    away = f"http://localhost:{port}/items/1"  # same server, a host the spec did not allow
    redirect = _tool(site, name="hop", url=f"http://{site}/redirect?to={{q}}")
    steps = [tools(call("hop", {"id": 1, "q": away}), call("hop", {"id": 1, "q": f"http://{site}/items/2"})),
             {"content": "done"}]  # fmt: skip
    result = client.submit(spec(steps, http_tools=[redirect])).wait(timeout=60)
    refused, followed = result.tool_calls
    assert not refused.success and refused.error.startswith("Refused: localhost is not in allow_hosts")
    assert followed.success and followed.output["body"]["path"] == "/items/2"
    assert [s["path"] for s in _Handler.seen].count("/items/1") == 0  # never sent


def test_a_declared_tool_named_in_approval_sends_nothing_until_approved(client, worker, spec, site):
    s = spec([tools(call("get_item", {"id": 9}, call_id="c_get")), {"content": "done"}],
             http_tools=[_tool(site)], approval=["get_item"])  # fmt: skip
    handle = client.submit(s)
    wait_for(handle.pending_approvals, 30)
    time.sleep(0.5)
    assert "/items/9" not in [r["path"] for r in _Handler.seen]  # parked, not sent
    assert handle.approve("c_get") == "ok"
    [record] = handle.wait(timeout=60).tool_calls
    assert record.success and record.output["body"]["path"] == "/items/9"
    assert [r["path"] for r in _Handler.seen].count("/items/9") == 1


def test_a_response_past_the_time_limit_is_a_failed_record(client, worker, spec, site):
    trickle = _tool(site, name="trickle", url=f"http://{site}/trickle", timeout_s=1.5)
    started = time.monotonic()
    result = client.submit(spec([tools(call("trickle", {"id": 1})), {"content": "done"}],
                                http_tools=[trickle])).wait(timeout=60)  # fmt: skip
    [record] = result.tool_calls
    assert not record.success and record.error == "Timeout: tool call exceeded 1.5s"
    assert result.status == Status.completed and time.monotonic() - started < 15  # not the 20 s body


def test_metadata_address_refused_before_any_connection(client, worker, spec):
    meta = {"name": "meta", "description": "cloud metadata", "allow_hosts": ["169.254.169.254"],
            "url": "http://169.254.169.254/latest/meta-data/"}  # fmt: skip
    s = spec([tools(call("meta")), {"content": "done"}], http_tools=[meta])
    result = client.submit(s).wait(timeout=60)
    [record] = result.tool_calls
    assert not record.success and "link-local or metadata" in record.error


def test_worker_variables_only_where_the_operator_allows(deployment, spec, site, model_server):
    bases = f"{model_server.api_base},http://{site}/items"  # the scripted model's too
    d = deployment(TOOLOOP_ALLOWED_API_BASES=bases, TRACKER_API_KEY=SECRET)
    d.start_worker("-c", "2")
    auth = {"Authorization": "Bearer ${TRACKER_API_KEY}"}
    ok = _tool(site, env_headers=auth)
    result = d.client.submit(spec([tools(call("get_item", {"id": 1})), {"content": "done"}],
                                  http_tools=[ok])).wait(timeout=60)  # fmt: skip
    [record] = result.tool_calls
    assert record.success and record.output["body"]["auth"] == f"Bearer {SECRET}"
    # refused at submit: a URL outside TOOLOOP_ALLOWED_API_BASES, a variable outside the allowlist
    outside = _tool(site, name="echo", url=f"http://{site}/echo", env_headers=auth)
    key = _tool(site, env_headers={"X-Key": "${TOOLOOP_SECRET_KEY}"})
    for declared, why in ((outside, "not under TOOLOOP_ALLOWED_API_BASES"),
                          (key, "not allowed by TOOLOOP_ALLOWED_KEY_ENVS")):  # fmt: skip
        with pytest.raises(SpecError, match=why):
            d.client.submit(spec([{"content": "x"}], http_tools=[declared]))
    # ...and by the worker, whatever the producer allowed: a producer with a wider setting
    from orchestrator import Client
    from orchestrator.store import RunStore

    wider = d.settings.model_copy(update={"allowed_api_bases": f"{model_server.api_base},http://{site}"})
    lax = Client(settings=wider, store=RunStore.from_settings(wider))
    result = lax.submit(spec([tools(call("echo", {"id": 1})), {"content": "done"}],
                             http_tools=[outside])).wait(timeout=60)  # fmt: skip
    [record] = result.tool_calls
    assert not record.success and "not under TOOLOOP_ALLOWED_API_BASES" in record.error


def test_agent_folder_tool_files(client, worker, spec, site, tmp_path, monkeypatch):
    folder = tmp_path / "agents" / "bot" / "tools"
    folder.mkdir(parents=True)
    (folder / "items.yaml").write_text(json.dumps(_tool(site)))
    (tmp_path / "stray.yaml").write_text(json.dumps(_tool(site)))
    monkeypatch.chdir(tmp_path)
    s = spec([tools(call("get_item", {"id": 5})), {"content": "done"}],
             http_tools=["agents/bot/tools/items.yaml"])
    handle = client.submit(s)
    assert handle.wait(timeout=60).tool_calls[0].output["body"]["path"] == "/items/5"
    stored = client.store.spec(handle.run_id).http_tools
    assert isinstance(stored[0], HttpTool) and stored[0].name == "get_item"  # read at submit, stored inline
    (tmp_path / "agents" / "bot" / "skills").mkdir()
    (tmp_path / "agents" / "bot" / "skills" / "items.yaml").write_text(json.dumps(_tool(site)))
    for path, why in (("stray.yaml", "outside the agents folder"),
                      ("agents/bot/skills/items.yaml", "not in an agent's tools folder")):  # fmt: skip
        with pytest.raises(SpecError, match=why):
            client.submit(spec([{"content": "x"}], http_tools=[path]))


def test_submit_refuses_bad_declarations(client, spec, site):
    cases = [
        (_tool(site, allow_hosts=[]), "allow_hosts"),
        (_tool(site, url="http://{q}/x"), "fixed host"),
        (_tool(site, url=f"http://{site}/{{nope}}"), "placeholders"),
        (_tool(site, name="add"), "catalog"),
        (_tool(site, url="http://elsewhere.test/{id}"), "not in allow_hosts"),
    ]
    for declared, why in cases:
        with pytest.raises(SpecError, match=why):
            client.submit(spec([{"content": "x"}], http_tools=[declared], tools=["add"]))


def test_check_target_rules():
    tool = HttpTool.model_validate(_tool("api.example.test", allow_hosts=["api.example.test", "[::1]:8080"]))
    settings = Settings()
    check_target(tool, "https://api.example.test/items/1", settings)
    check_target(tool, "http://[::1]:8080/x", settings)
    for url in ("https://api.example.test.evil.net/", "https://evil.net/?h=api.example.test",
                "http://[::1]:8081/x", "ftp://api.example.test/", "https://u:p@api.example.test/"):
        with pytest.raises(Refused):
            check_target(tool, url, settings)


class _Resolver:
    """``socket.getaddrinfo`` for one name, the attacker's: each lookup takes the next
    answer of ``answers`` (the last repeats; ``None`` is a failed lookup), as a name with
    TTL 0 can; every other name resolves as usual."""

    def __init__(self, name: str, answers: list[list[str] | None]) -> None:
        self.name, self.answers, self.lookups = name, answers, 0

    def __call__(self, host, port, *args, **kwargs):
        if host != self.name:
            return _REAL_GETADDRINFO(host, port, *args, **kwargs)
        answer = self.answers[min(self.lookups, len(self.answers) - 1)]
        self.lookups += 1
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        family = {4: socket.AF_INET, 6: socket.AF_INET6}
        return [(family[ipaddress.ip_address(a).version], socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 (a, int(port))) for a in answer]  # fmt: skip


_REAL_GETADDRINFO = socket.getaddrinfo


def test_a_rebinding_name_reaches_only_the_address_that_was_checked(site, monkeypatch):
    """The tool process resolves through a resolver we control. A name answering a
    loopback address to the first lookup and 0.0.0.0 (refused like 169.254.169.254, and
    reachable here: Linux connects it to loopback) to later ones; a name whose first lookup
    fails; a name answering a metadata address beside a good one; and a redirect to the
    rebinding name. Every socket the call opens is recorded: only checked addresses."""
    from worker.sources import http_tools

    port = int(site.split(":")[1])
    dialed: list[tuple] = []
    real_connect = socket.socket.connect

    def connect(sock, address):
        if isinstance(address, tuple) and address[1] == port:
            dialed.append(address[:2])
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    name = "rebind.test"
    hosts = [f"{name}:{port}", site]
    tool = _tool(site, url=f"http://{name}:{port}/items/{{id}}", allow_hosts=hosts)
    hop = _tool(site, name="hop", url=f"http://{site}/redirect?to={{q}}", allow_hosts=hosts)
    cases = [  # (declaration, arguments, answers, expected outcome)
        (tool, {"id": 1}, [["127.0.0.1"], ["0.0.0.0"]], "ok"),
        (tool, {"id": 2}, [None, ["0.0.0.0"]], "HttpError: ConnectError: rebind.test: cannot resolve"),
        (tool, {"id": 3}, [["127.0.0.1", "169.254.169.254"]], "Refused: rebind.test resolves to"),
        (hop, {"id": 4, "q": f"http://{name}:{port}/items/4"}, [["127.0.0.1"], ["0.0.0.0"]], "ok"),
    ]
    for declared, arguments, answers, expected in cases:
        dialed.clear()
        resolver = _Resolver(name, answers)
        monkeypatch.setattr(socket, "getaddrinfo", resolver)
        outcome = http_tools.call(declared, arguments, 10, Settings(), lambda: True)
        where = (arguments, outcome.error, dialed)
        assert all(address[0] == "127.0.0.1" for address in dialed), where  # never 0.0.0.0
        if expected == "ok":
            assert outcome.ok and outcome.output["body"]["path"] == f"/items/{arguments['id']}", where
            assert resolver.lookups == 1, where  # resolved once, for the one connection to it
        else:
            assert not outcome.ok and outcome.error.startswith(expected), where
            assert dialed == [] or declared is hop, where


def test_a_connection_that_reaches_another_peer_than_the_checked_address_is_refused(site, monkeypatch):
    """The last step of item 1: after the socket is open, the peer it reached is compared
    with the address that was checked. An operator who lets a host reach link-local and
    metadata addresses (TOOLOOP_ALLOWED_API_BASES) has that host resolve to 0.0.0.0, which
    the kernel connects to 127.0.0.1: the peer is not the checked address, and the call is
    refused before a byte is sent. The same host answering 127.0.0.1 is reached."""
    from worker.sources import http_tools

    port, name = int(site.split(":")[1]), "peer.test"
    settings = Settings(allowed_api_bases=f"http://{name}:{port}/")  # link-local allowed for it
    declared = _tool(site, url=f"http://{name}:{port}/items/{{id}}", allow_hosts=[f"{name}:{port}"])
    monkeypatch.setattr(socket, "getaddrinfo", _Resolver(name, [["0.0.0.0"]]))
    refused = http_tools.call(declared, {"id": 5}, 10, settings, lambda: True)
    assert not refused.ok and refused.error.startswith(
        f"Refused: {name}: the connection reached 127.0.0.1, not the checked 0.0.0.0"
    ), refused.error
    monkeypatch.setattr(socket, "getaddrinfo", _Resolver(name, [["127.0.0.1"]]))
    reached = http_tools.call(declared, {"id": 6}, 10, settings, lambda: True)
    assert reached.ok and reached.output["body"]["path"] == "/items/6", reached.error


def test_templates_take_bare_placeholders_only(client, spec, site, tmp_path):
    """A format spec (`{q:>400000000}` renders 400 MB), a conversion, an attribute or an
    index in a template is refused at submit, naming the field, and again by the worker
    for a declaration that did not pass through submit (Redis written by hand)."""
    from worker.sources import http_tools

    wide = "{q:>400000000}"
    cases = [
        (_tool(site, url=f"http://{site}/items/{wide}"), "url"),
        (_tool(site, headers={"X-Trace": "{q!r}"}), "headers.X-Trace"),
        (_tool(site, method="POST", body={"a": ["{q:>9}"]}), "body.a.0"),
        (_tool(site, url=f"http://{site}/items/{{q.__class__}}"), "url"),
        (_tool(site, url=f"http://{site}/items/{{q[0]}}"), "url"),
        (_tool(site, url=f"http://{site}/items/{{}}"), "url"),
    ]
    for declared, field in cases:
        with pytest.raises(SpecError, match=f"{field}: .*only bare {{name}} placeholders"):
            client.submit(spec([{"content": "x"}], http_tools=[declared]))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec([{"content": "x"}], http_tools=[cases[0][0]])))
    import subprocess
    import sys

    cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 2 and "url: " in cli.stderr and wide in cli.stderr, cli.stderr
    # the worker: the declaration as a forged payload would carry it, never rendered
    started = time.monotonic()
    for declared, field in cases:
        outcome = http_tools.call(declared, {"id": 1, "q": "x"}, 10, Settings(), lambda: True)
        assert not outcome.ok and "only bare {name} placeholders" in outcome.error, (field, outcome)
        assert outcome.error.startswith("Refused: ") and field in outcome.error
    assert time.monotonic() - started < 5
    with pytest.raises(Refused, match="only bare"):
        http_tools._render(wide, {"q": "x"})  # the renderer itself takes no format spec


def test_a_pinned_connection_still_names_the_host_in_http_and_tls(site, monkeypatch, tmp_path):
    """Item 1's other half: the socket goes to the checked address, and the request still
    names the host: its Host header, and TLS's server name (SNI; the certificate is then
    checked against that name, not the address). A TLS server on loopback with a
    certificate nobody trusts records the name the client asked for, and the call fails
    on the certificate, never reaching the handler."""
    import ssl
    import subprocess

    from worker.sources import http_tools

    port, name = int(site.split(":")[1]), "pinned.test"
    monkeypatch.setattr(socket, "getaddrinfo", _Resolver(name, [["127.0.0.1"]]))
    plain = _tool(site, url=f"http://{name}:{port}/items/{{id}}", allow_hosts=[f"{name}:{port}"])
    outcome = http_tools.call(plain, {"id": 7}, 10, Settings(), lambda: True)
    assert outcome.ok and outcome.output["body"]["host"] == f"{name}:{port}", outcome

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    asked: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda _sock, server_name, _ctx: asked.append(server_name)
    listener = socket.create_server(("127.0.0.1", 0))
    tls_port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with contextlib.suppress(OSError, ssl.SSLError):
            context.wrap_socket(conn, server_side=True).close()
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        tls = _tool(site, url=f"https://{name}:{tls_port}/items/{{id}}", allow_hosts=[f"{name}:{tls_port}"])
        outcome = http_tools.call(tls, {"id": 8}, 10, Settings(), lambda: True)
    finally:
        listener.close()
    assert not outcome.ok and "CERTIFICATE_VERIFY_FAILED" in outcome.error, outcome.error
    assert asked == [name]  # SNI named the host, though the socket went to 127.0.0.1
