"""Secrets scrubbed from everything stored or shown: records, messages, events, Redis, logs,
the API and the task arguments Flower shows."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from orchestrator import Status
from orchestrator.scrub import MASK, SHORT_MASK, ScrubFilter, scrub_text, scrub_value
from tests.conftest import free_port
from tests.helpers import call, flower, flower_tasks, once_flower_shows, redis_values, tools, wait_for
from tests.tools import LEAKED

# -- the patterns -----------------------------------------------------------------------------
KEY = "sk-live-4f9a8b7c6d5e4f3a2b1c"


@pytest.mark.parametrize(
    "text, expected",
    [
        (f"api_key={KEY}", "api_key=sk-l" + MASK),
        (f'{{"api_key": "{KEY}", "n": 5}}', '{"api_key": "sk-l' + MASK + '", "n": 5}'),
        (f'{{\\"apiKey\\": \\"{KEY}\\"}}', '{\\"apiKey\\": \\"sk-l' + MASK + '\\"}'),
        ("Authorization: Bearer abcdefgh12345678", "Authorization: Bearer abcd" + MASK),
        ("password=hunter2", "password=" + SHORT_MASK),
        ("client_secret=verysecretvalue; x-api-key: 0123456789",
         f"client_secret=very{MASK}; x-api-key: 0123{MASK}"),
        ("secret_key='abcdefghij' user_key = 'qwertyuiop'",
         f"secret_key='abcd{MASK}' user_key = 'qwer{MASK}'"),
        ("set-cookie: sessionid=abcdef123456789", f"set-cookie: sess{MASK}"),
        ("credential:longcredentialvalue", f"credential:long{MASK}"),
        (f"key {KEY} inline", f"key sk-l{MASK} inline"),
        ("sk-ant-api03-abcdefghijklmnop", f"sk-a{MASK}"),
        ("ghp_0123456789abcdefghijABCDEFGHIJ", f"ghp_{MASK}"),
        ("id AKIAIOSFODNN7EXAMPLE", f"id AKIA{MASK}"),
        ("xoxb-123456789012-abcdefghij", f"xoxb{MASK}"),
        (f"jwt {LEAKED['bearer']}", f"jwt eyJh{MASK}"),
        ("tokens_used: 180, max_tokens=5, token count 3", "tokens_used: 180, max_tokens=5, token count 3"),
        ("skip-this and sk-short", "skip-this and sk-short"),
        ("dsn postgres://app:hunter2hunter2@db:5432/app", f"dsn postgres://app:hunt{MASK}@db:5432/app"),
        ("redis://:pw@host/0 and http://host:8080/x", f"redis://:{SHORT_MASK}@host/0 and http://host:8080/x"),
    ],
)  # fmt: skip
def test_scrub_text(text, expected):
    assert scrub_text(text) == expected
    assert scrub_text(expected) == expected  # idempotent


def test_long_text_is_scrubbed_in_pieces_and_nothing_slips_between_them():
    from orchestrator import scrub

    filler = "lorem ipsum " * (scrub.PIECE_CHARS // 12)
    secrets = [f"api_key: {KEY}", "password:\nhunter2hunter2", "Authorization: Bearer abcdefgh12345678",
               f"token={KEY}", "postgres://app:hunter2hunter2@db/app", "ghp_0123456789abcdefghijABCDEFGHIJ"]
    # each secret placed across a piece boundary, at every offset around it
    for secret in secrets:
        for shift in range(-len(secret), 2):
            text = filler[: scrub.PIECE_CHARS + shift] + " " + secret + " " + filler
            clean = scrub_text(text)
            assert "hunter2hunter2" not in clean and KEY[6:] not in clean and "12345678" not in clean, secret
            assert "0123456789abcdef" not in clean, secret
            assert clean == scrub._scrub(text), (secret, shift)  # as one pass would


LONG_KEY = "sk-proj-" + "Ab3dE7fG9h" * 5  # 58 characters, no whitespace around it below
BASE64 = "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo+/0123456789abcdefghij"  # 56: base64, '+' and '/'
LONG_VALUE = "s3cR3tV4lu3+/" * 5  # a credential's value: base64, 65 characters


def _around_the_boundary(shape: str, at: int) -> str:
    """Text without whitespace of ``shape`` whose secret starts ``at`` characters before the
    first piece's end (PIECE_CHARS): before the fix, the piece boundary cut it."""
    from orchestrator.scrub import PIECE_CHARS

    def fill(n: int) -> str:
        return (BASE64 * (n // len(BASE64) + 1))[:n]

    before = {  # what comes before the secret, and after it
        "json": ('{"blob":"', '","ref":"', '","more":"', '"}'),  # minified JSON: a token shape
        "json-pair": ('{"blob":"', '","api_key":"', '","more":"', '"}'),  # a credential-named field
        "query": ("data=", "&ref=", "&next=", ""),  # a query string: base64 values, no quotes
        "pair-base64": ("data=", "&client_secret=", "&next=", ""),  # a long value holding + and /
        "run": ("", "_", "_", ""),  # one run of token characters: the token runs to its end
    }[shape]
    opening, lead, trail, closing = before
    secret = LONG_KEY if shape != "pair-base64" else LONG_VALUE
    head = opening + fill(PIECE_CHARS - at - len(opening) - len(lead)) + lead
    if shape == "run":
        head = "x" * (PIECE_CHARS - at - 1) + "_"
        return head + secret + trail + "y" * 20_000  # the token runs on through the next piece
    return head + secret + trail + fill(2_000) + closing


@pytest.mark.parametrize("shape", ["json", "json-pair", "query", "pair-base64", "run"])
def test_a_secret_cut_at_a_piece_boundary_of_text_without_whitespace_is_masked(shape, monkeypatch):
    """Issue 22 item 7: minified JSON or base64 has no whitespace to cut a long text at, so
    its pieces were cut at PIECE_CHARS; a secret straddling the cut changed the context it
    was scrubbed with, and the piece was then scrubbed alone: the key's characters after
    the cut came out in clear. At every offset the pieces now give what one pass gives."""
    from orchestrator import scrub

    monkeypatch.setattr(scrub, "PIECE_CHARS", 16_384)  # smaller pieces, the same cuts: 4x quicker

    secret = LONG_KEY if shape != "pair-base64" else LONG_VALUE
    for at in range(-3, len(secret) + 4):
        text = _around_the_boundary(shape, at)
        clean = scrub_text(text)
        assert clean == scrub._scrub(text), (shape, at)  # as one pass would
        assert not [secret[i : i + 12] for i in range(4, len(secret) - 12) if secret[i : i + 12] in clean], (
            shape, at)  # fmt: skip


def test_hints_fold_case_as_the_pattern_does():
    # re.IGNORECASE matches these spellings; the cheap check that skips the pattern must see them too
    for key in ("PASSWORD", "pa\u017fsword", "api_\u212aey", "credent\u0131al", "credent\u0130al"):
        assert scrub_text(f"{key}=hunter2hunter2") == f"{key}=hunt{MASK}", key
    assert scrub_text("x" * 5_000_000) == "x" * 5_000_000


def test_scrub_value_keeps_json_types():
    value = {"api_key": KEY, "retries": 3, "ok": True, "items": [1, f"token={KEY}"],
             "credentials": {"user": "bob", "port": 5432}, "tokens": 12}  # fmt: skip
    assert scrub_value(value) == {
        "api_key": "sk-l" + MASK, "retries": 3, "ok": True, "items": [1, "token=sk-l" + MASK],
        "credentials": {"user": SHORT_MASK, "port": 5432}, "tokens": 12,
    }  # fmt: skip
    assert scrub_value(42) == 42 and scrub_value(None) is None and scrub_value([KEY]) == ["sk-l" + MASK]


def test_log_filter_masks_message_args_and_traceback():
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(ScrubFilter())
    logger = logging.getLogger("tooloop.test.scrub")
    logger.addHandler(handler)
    try:
        logger.warning("calling with api_key=%s", KEY)
        try:
            raise RuntimeError(f"refused: password={KEY}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert records[0].getMessage() == "calling with api_key=sk-l" + MASK
    assert KEY not in records[1].exc_text and "password=sk-l" + MASK in records[1].exc_text


# -- a run whose tool leaks credentials ----------------------------------------------------------
@pytest.fixture(scope="module")
def api_base(store) -> Iterator[str]:
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    app = create_app(Settings(api_tokens="tok-scrub=default"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=10)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def secrets_in(blob: str | bytes) -> list[str]:
    text = blob.decode(errors="replace") if isinstance(blob, bytes) else blob
    return [name for name, value in LEAKED.items() if value in text]


def test_no_credential_from_a_tool_output_is_stored_or_shown(client, worker, spec, model_server, store,
                                                              api_base):  # fmt: skip
    answer = f"Done. For the record the key was {LEAKED['api_key']} and aws {LEAKED['aws']}."
    s = spec([tools(call("leaky")), {"content": answer}], tools=["leaky"])
    run = client.submit(s)
    result = run.wait(timeout=30)
    assert result.status == Status.completed
    # the record keeps its shape and types; credentials are masked
    [record] = result.tool_calls
    assert record.output["count"] == 3 and record.output["config"]["retries"] == 3
    assert record.output["config"]["api_key"] == "sk-l" + MASK
    assert f"password=hunt{MASK}" in record.output["log"] and f"ghp_{MASK}" in record.output["log"]
    assert result.content == f"Done. For the record the key was sk-l{MASK} and aws AKIA{MASK}."
    assert secrets_in(result.model_dump_json()) == []
    # by default the model saw the scrubbed output too
    seen = model_server.calls(s["model"])[1]["messages"][-1]["content"]
    assert json.loads(seen)["config"]["api_key"] == "sk-l" + MASK and secrets_in(seen) == []
    # every Redis key of the run, events included
    values = redis_values(store.redis, f"{store.keys.prefix}:*{run.run_id}*")
    assert store.keys.events(run.run_id) in values
    assert [key for key, items in values.items() if any(secrets_in(v) for v in items)] == []
    # the API
    reply = httpx.get(f"{api_base}/api/runs/{run.run_id}", headers={"Authorization": "Bearer tok-scrub"})
    assert reply.status_code == 200 and reply.json()["content"] == result.content
    assert secrets_in(reply.text) == []
    with httpx.stream("GET", f"{api_base}/api/runs/{run.run_id}/events",
                      headers={"Authorization": "Bearer tok-scrub"}, timeout=10) as stream:  # fmt: skip
        assert secrets_in("".join(stream.iter_text())) == []
    # the worker's log
    assert secrets_in(worker.log.read_bytes()) == []


def test_a_provider_error_naming_a_key_is_scrubbed_in_the_result_and_the_log(client, worker, spec):
    message = f"Incorrect API key provided: {LEAKED['api_key']}. Find your key at platform.example."
    s = spec([{"status": 401, "error": message}], model_params={"max_retries": 0})
    result = client.submit(s).wait(timeout=30)
    assert (result.exit, result.error_type) == ("error", "AuthenticationError")
    assert f"Incorrect API key provided: sk-l{MASK}" in result.error and secrets_in(result.error) == []
    # the turn logged the failure (the line is there) with the key masked
    log = wait_for(lambda: f"sk-l{MASK}. Find your key" in worker.log.read_text() and worker.log.read_text())
    assert secrets_in(log) == []


def test_opt_out_shows_the_model_originals_kept_sealed_in_redis(client, worker, spec, model_server, store):
    s = spec([tools(call("leaky")), {"content": "ok"}], tools=["leaky"], scrub_model_input=False)
    run = client.submit(s)
    result = run.wait(timeout=30)
    assert result.status == Status.completed
    seen = model_server.calls(s["model"])[1]["messages"][-1]
    assert json.loads(seen["content"])["config"]["api_key"] == LEAKED["api_key"]  # the model saw it
    assert set(seen) == {"role", "tool_call_id", "content"}  # and nothing of ours went on
    values = redis_values(store.redis, f"{store.keys.prefix}:*{run.run_id}*")
    assert [key for key, items in values.items() if any(secrets_in(v) for v in items)] == []
    assert result.tool_calls[0].output["config"]["api_key"] == "sk-l" + MASK


def test_opt_out_needs_the_secret_key(spec, store):
    from orchestrator import Client, SpecError
    from orchestrator.settings import Settings

    keyless = Client(settings=Settings(secret_key=""), store=store)
    keyless.store = type(store)(store.redis, Settings(key_prefix=store.keys.prefix, secret_key=""))
    with pytest.raises(SpecError, match="TOOLOOP_SECRET_KEY"):
        keyless.submit(spec([{"content": "x"}], scrub_model_input=False))


def test_arguments_holding_a_secret_travel_sealed(client, worker, spec, store, model_server):
    import hashlib

    text = f"token={LEAKED['github']}"
    s = spec([tools(call("fingerprint", {"text": text, "seconds": 1.5})), {"content": "ok"}],
             tools=["fingerprint"])  # fmt: skip
    run = client.submit(s)
    # while the call runs, its payload waits in Redis (for re-dispatch): sealed, not in clear
    payload = wait_for(lambda: store.redis.hget(store.keys.call_args(run.run_id), "1.0"))
    assert json.loads(payload)["arguments"].startswith("sealed:v2:") and secrets_in(payload) == []
    result = run.wait(timeout=30)
    [record] = result.tool_calls
    assert record.output == hashlib.sha256(text.encode()).hexdigest()  # the tool got the original
    assert record.inputs == {"text": f"token=ghp_{MASK}", "seconds": 1.5}
    assert secrets_in(json.dumps(model_server.calls(s["model"])[1]["messages"])) == []
    assert secrets_in(result.model_dump_json()) == []


# -- Flower ------------------------------------------------------------------------------------------
def test_flower_shows_tool_task_arguments_masked(client, worker, spec):
    def submit() -> str:
        bindings = {"db": f"postgres://app:{LEAKED['password']}@db/app", "password": LEAKED["password"]}
        text = f"token={LEAKED['github']}"
        s = spec([tools(call("fingerprint", {"text": text})), {"content": "3"}], tools=["fingerprint"],
                 context={"resource_bindings": bindings})  # fmt: skip
        handle = client.submit(s)
        handle.wait(timeout=30)
        return handle.run_id

    def tool_args(run_id: str) -> str | None:
        args = [t.get("args") for t in flower_tasks(base, run_id) if t["name"] == "tooloop.tool"]
        return next((a for a in args if a), None)

    with flower() as base:
        shown = once_flower_shows(submit, tool_args)
    # the message names the call (bindings, policy, folder are read from the stored spec);
    # the model's arguments are shown sealed, as they travel
    assert "'tool': 'fingerprint'" in shown and "'key': '1.0'" in shown
    assert "'arguments': 'sealed:v2:" in shown and "bindings" not in shown
    assert LEAKED["password"][:8] not in shown and secrets_in(shown) == []


