"""Bounded outputs: what the model sees, what Redis keeps, what the API accepts."""

from __future__ import annotations

import json

import pytest

from orchestrator import Status
from orchestrator.bounds import (
    RECORD_MAX_BYTES,
    REPLY_MAX_CHARS,
    STEER_MAX_CHARS,
    bound_value,
    cut_text,
    json_size,
)
from tests.helpers import call, redis_values, tools

BIG = 5_000_002  # characters of the tool's output


# -- pure ------------------------------------------------------------------------------------
def test_cut_text_keeps_head_two_thirds_and_tail_third():
    text = "".join(chr(ord("a") + i % 26) for i in range(10_000))
    out = cut_text(text, 3000)
    assert len(out) <= 3000 and out.startswith(text[:1000]) and out.endswith(text[-900:])
    head, _, tail = out.partition("\n[... ")
    assert len(head) == pytest.approx(2 * len(tail.split("...]\n")[1]), abs=2)
    cut = len(text) - len(head) - len(tail.split("...]\n")[1])
    assert f"{cut:,} of 10,000 characters cut" in out
    assert cut_text("short", 3000) == "short"


@pytest.mark.parametrize(
    "value",
    ["y" * 100_000, {"data": "y" * 100_000, "n": 5}, list(range(50_000)),
     {"rows": [{"id": i, "name": "row"} for i in range(10_000)]}, {f"k{i}": i for i in range(10_000)},
     {"a": {"b": list(range(20_000))}}, ['"' * 30_000]],
)  # fmt: skip
def test_bound_value_fits_and_keeps_its_type(value):
    out = bound_value(value, RECORD_MAX_BYTES)
    assert type(out) is type(value) and json_size(out) <= RECORD_MAX_BYTES
    assert "cut" in json.dumps(out)  # a marker says so
    assert bound_value(7, 10) == 7 and bound_value({"a": 1}, 100) == {"a": 1}


# -- a 5 MB tool output ------------------------------------------------------------------------
def test_huge_tool_output_is_bounded_for_the_model_and_in_redis(client, worker, spec, model_server, store):
    s = spec([tools(call("big_output", {"chars": BIG})), {"content": "done"}], tools=["big_output"])
    run = client.submit(s)
    result = run.wait(timeout=60)
    assert (result.status, result.content) == (Status.completed, "done")
    # what the model saw: at most max_tool_output_chars (default 50,000), head and tail kept
    seen = model_server.calls(s["model"])[1]["messages"][-1]["content"]
    assert len(seen) <= 50_000 and seen.startswith("HEADxxx") and seen.endswith("xxxTAIL")  # not JSON-quoted
    assert f"of {BIG:,} characters cut" in seen
    # the record: a string still, within 16 KiB, saying how large the output was
    [record] = result.tool_calls
    assert record.success and isinstance(record.output, str)
    assert record.output.startswith("HEAD") and record.output.endswith("TAIL")
    assert f"of {BIG:,} characters cut" in record.output
    assert len(record.model_dump_json()) <= RECORD_MAX_BYTES
    # every Redis key of the run: no value near the output's size, one bounded copy per key
    values = redis_values(store.redis, f"{store.keys.prefix}:*{run.run_id}*")
    assert values, "the run's keys were found"
    for key, items in values.items():
        assert max(map(len, items), default=0) <= 60_000, key
    holding = [key for key, items in values.items() if any(b"x" * 10_000 in v for v in items)]
    assert sorted(holding) == sorted({store.keys.messages(run.run_id), store.keys.calls(run.run_id)})
    assert sum(len(v) for items in values.values() for v in items) < 120_000


def test_tool_output_limit_per_spec(client, worker, spec, model_server):
    s = spec([tools(call("big_output", {"chars": 20_000})), {"content": "done"}], tools=["big_output"],
             max_tool_output_chars=1000)  # fmt: skip
    assert client.submit(s).wait(timeout=30).status == Status.completed
    seen = model_server.calls(s["model"])[1]["messages"][-1]["content"]
    assert len(seen) <= 1000 and "of 20,000 characters cut" in seen


def test_many_rows_keep_their_shape(client, worker, spec):
    s = spec([tools(call("big_rows", {"count": 50_000})), {"content": "done"}], tools=["big_rows"])
    [record] = client.submit(s).wait(timeout=60).tool_calls
    assert isinstance(record.output, dict) and record.output["count"] == 50_000
    rows = record.output["rows"]
    assert rows[0] == {"id": 0, "name": "row 0"} and rows[-1].endswith("more items cut ...]")
    assert len(record.model_dump_json()) <= RECORD_MAX_BYTES


# -- a 5 MB model reply ---------------------------------------------------------------------
def test_huge_model_reply_is_refused_and_never_stored_whole(client, worker, spec, store):
    s = spec([{"content": "z" * 5_000_000}])
    run = client.submit(s)
    result = run.wait(timeout=60)
    assert (result.status, result.exit, result.error_type) == (Status.failed, "error", "ReplyTooLarge")
    assert "5,000,000 characters" in result.error and f"{REPLY_MAX_CHARS:,}" in result.error
    assert result.tokens_used == 30  # the reply was billed
    values = redis_values(store.redis, f"{store.keys.prefix}:*{run.run_id}*")
    assert max(len(v) for items in values.values() for v in items) <= 10_000


def test_huge_tool_arguments_are_refused(client, worker, spec):
    s = spec([tools(call("add", {"a": 1, "b": 2, "pad": "p" * 200_000}))], tools=["add"])
    result = client.submit(s).wait(timeout=60)
    assert (result.exit, result.error_type, result.tool_calls) == ("error", "ReplyTooLarge", [])


# -- control inputs ----------------------------------------------------------------------------
def test_steer_text_has_a_limit(client, worker, spec, holds):
    from tests.helpers import gate

    s = spec([{"content": "ok", "hold": gate(holds)}])
    run = client.submit(s)
    with pytest.raises(ValueError, match="limit"):
        run.steer("s" * (STEER_MAX_CHARS + 1))
    assert run.steer("s" * STEER_MAX_CHARS) == "ok"


def test_client_and_run_handle_refuse_what_the_api_refuses_before_writing(deployment, spec, model_server):
    """Failed before: ``Client.submit`` wrote a 5 MB prompt and took `true` and "5" for numbers;
    ``RunHandle.abort`` took a reason of any length. The API's bounds hold at every entrance."""
    import yaml

    from orchestrator.bounds import REASON_MAX_CHARS, SPEC_MAX_BYTES, TooLong
    from orchestrator.models import RunSpec
    from orchestrator.validation import SpecError, parse_spec_data

    d = deployment()  # a key prefix of its own, and no worker: a run stays queued
    base = spec([{"content": "x"}])
    rule = {"when": "tool_repeated", "then": "steer"}
    refused = [
        ({**base, "prompt": "p" * SPEC_MAX_BYTES}, f"the limit is {SPEC_MAX_BYTES:,}"),
        (RunSpec(**{**base, "prompt": "p" * SPEC_MAX_BYTES}), f"the limit is {SPEC_MAX_BYTES:,}"),
        ({**base, "max_iterations": True}, "max_iterations: Input should be a valid integer, not True"),
        ({**base, "max_iterations": "5"}, "max_iterations: Input should be a valid integer, not '5'"),
        ({**base, "tool_timeout_s": "300"}, "tool_timeout_s: Input should be a valid number"),
        ({**base, "scrub_model_input": "false"}, "scrub_model_input: Input should be a valid boolean"),
        ({**base, "sandbox": {"memory_mb": 512.0}}, "sandbox.memory_mb"),
        ({**base, "supervisor": {"rules": [{**rule, "count": True}]}}, "supervisor.rules.0.count"),
        ({**base, "supervisor": {"rules": [{**rule, "message": "m" * (STEER_MAX_CHARS + 1)}]}},
         "supervisor.rules.0.message"),
    ]  # fmt: skip
    for data, said in refused:
        with pytest.raises(SpecError) as caught:
            d.client.submit(data)
        assert said in str(caught.value), (said, caught.value)
    assert list(d.store.redis.scan_iter(f"{d.prefix}*", count=1000)) == []  # nothing written or enqueued
    # numbers as YAML writes them still parse: 5 is an int, and an int is a float
    from_yaml = parse_spec_data({**base, **yaml.safe_load("max_iterations: 5\ntool_timeout_s: 5\n")})
    assert (from_yaml.max_iterations, from_yaml.tool_timeout_s) == (5, 5.0)

    run = d.client.submit(base)
    events = d.store.redis.xlen(d.store.keys.events(run.run_id))
    with pytest.raises(TooLong, match=f"the limit is {REASON_MAX_CHARS:,}"):
        run.abort("r" * (REASON_MAX_CHARS + 1))
    with pytest.raises(TooLong, match=f"the limit is {REASON_MAX_CHARS:,}"):
        run.deny("call-1", "r" * (REASON_MAX_CHARS + 1))
    assert run.status() == Status.queued and d.store.redis.xlen(d.store.keys.events(run.run_id)) == events
    assert run.abort("r" * REASON_MAX_CHARS) == "ok" and run.status() == Status.aborted
