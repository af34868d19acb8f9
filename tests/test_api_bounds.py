"""The operator API's length limits over real HTTP: a body over 1 MiB (or one without a size),
a steer message over STEER_MAX_CHARS and an abort reason over REASON_MAX_CHARS answer 400,
and nothing is written."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from orchestrator import Status
from orchestrator.bounds import API_BODY_MAX_BYTES, REASON_MAX_CHARS, STEER_MAX_CHARS
from tests.helpers import gate
from tests.test_api import api_server  # noqa: F401  (a fixture, shared)


@pytest.fixture
def http(api_server) -> Iterator[httpx.Client]:  # noqa: F811
    with httpx.Client(base_url=api_server.base_url, headers={"Authorization": "Bearer tok-acme"},
                      timeout=30) as c:  # fmt: skip
        yield c


def runs_of_acme(client) -> set[str]:
    return {row["run_id"] for row in client.list(1000, "acme")}


def test_a_body_over_the_limit_is_refused_unread(http, client, worker, spec) -> None:
    before = runs_of_acme(client)
    big = spec([{"content": "x"}], prompt="p" * API_BODY_MAX_BYTES)
    reply = http.post("/api/runs", json=big)
    assert reply.status_code == 400 and f"{API_BODY_MAX_BYTES:,} bytes" in reply.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the size cannot be checked first
        yield b'{"prompt": "x", '
        yield b'"model": "openai/x"}'

    chunked = http.post("/api/runs", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 400 and "Content-Length" in chunked.json()["detail"]
    assert runs_of_acme(client) == before  # nothing written
    small = http.post("/api/runs", json=spec([{"content": "x"}], prompt="p" * 1000))
    assert small.status_code == 201  # the limit is on size, not on submitting


def test_steer_and_abort_texts_have_limits(http, client, worker, spec, holds) -> None:
    release = gate(holds)
    run = client.submit(spec([{"content": "done", "hold": release}], tenant="acme"))
    url = f"/api/runs/{run.run_id}"
    too_long = http.post(f"{url}/steer", json={"message": "s" * (STEER_MAX_CHARS + 1)})
    assert too_long.status_code == 400 and f"{STEER_MAX_CHARS:,}" in too_long.json()["detail"]
    reason = http.post(f"{url}/abort", json={"reason": "r" * (REASON_MAX_CHARS + 1)})
    assert reason.status_code == 400 and f"{REASON_MAX_CHARS:,}" in reason.json()["detail"]
    assert client.store.state(run.run_id).get("status") in ("queued", "running")  # neither applied
    assert not client.store.redis.exists(client.store.keys.steer(run.run_id))
    assert http.post(f"{url}/steer", json={"message": "s" * STEER_MAX_CHARS}).status_code == 200
    assert http.post(f"{url}/abort", json={"reason": "r" * REASON_MAX_CHARS}).status_code == 200
    release.set()
    assert run.wait(timeout=30).status == Status.aborted
