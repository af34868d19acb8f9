"""The bounded loop end to end: every exit, every failed-record path, accounting."""

from __future__ import annotations

import json
import time

import pytest

from orchestrator import SpecError, Status
from tests.helpers import call, tools


def run(client, spec_dict, timeout: float = 30):
    return client.submit(spec_dict).wait(timeout=timeout)


# -- exits ---------------------------------------------------------------------------
def test_default_exit_with_one_tool_call(client, worker, spec, model_server):
    s = spec([tools(call("add", {"a": 2, "b": 3})), {"content": "5"}], tools=["add"])
    result = run(client, s)
    assert (result.status, result.exit, result.content) == (Status.completed, "default", "5")
    assert result.iterations == 2 and result.tokens_used == 60
    assert not result.terminated_by_limit and result.error is None
    [record] = result.tool_calls
    assert (record.tool_name, record.inputs, record.output, record.success) == (
        "add", {"a": 2, "b": 3}, 5, True)  # fmt: skip
    assert record.iteration == 1 and record.duration_ms > 0
    # the model saw its tool's result as the JSON encoding of the output
    second = model_server.calls(s["model"])[1]["messages"]
    assert second[-1]["role"] == "tool" and second[-1]["content"] == "5"
    assert second[-1]["tool_call_id"] == record.call_id


def test_enum_outcome_parsed_and_fence_stripped(client, worker, spec):
    answer = '```json\n{"outcome": "approved", "result": {"score": 7}}\n```'
    s = spec([{"content": answer}], outcome={"enum": ["approved", "rejected"]})
    result = run(client, s)
    assert (result.status, result.exit, result.result) == (Status.completed, "approved", {"score": 7})


def test_enum_instruction_reaches_the_model(client, worker, spec, model_server):
    s = spec([{"content": '{"outcome": "no", "result": 1}'}], outcome={"enum": ["yes", "no"]},
             steering="Be terse.")  # fmt: skip
    assert run(client, s).exit == "no"
    system = model_server.calls(s["model"])[0]["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Be terse.")
    assert '"outcome"' in system["content"] and '"yes", "no"' in system["content"]


@pytest.mark.parametrize(
    "answer, why",
    [('{"outcome": "maybe", "result": 1}', "not one of"), ("I approve", "not JSON"),
     ('{"result": 1}', "lacks")],
)  # fmt: skip
def test_bad_outcome_ends_on_error(client, worker, spec, answer, why):
    result = run(client, spec([{"content": answer}], outcome={"enum": ["approved", "rejected"]}))
    assert (result.status, result.exit) == (Status.failed, "error")
    assert why in result.error and result.error_type == "InvalidOutcome"


def test_max_iterations(client, worker, spec):
    s = spec([tools(call("add", {"a": 1, "b": 1}))], tools=["add"], max_iterations=2)
    result = run(client, s)
    assert (result.status, result.exit, result.terminated_by_limit) == (Status.failed, "max_iterations", True)
    assert result.iterations == 2 and len(result.tool_calls) == 2


def test_budget_exceeded_checked_at_top_of_turn(client, worker, spec):
    s = spec([tools(call("add", {"a": 1, "b": 1}), tokens=30)], tools=["add"], token_budget=50)
    result = run(client, s)
    assert (result.exit, result.status, result.terminated_by_limit) == ("budget_exceeded", "failed", True)
    assert result.iterations == 2 and result.tokens_used == 60


@pytest.mark.parametrize("status, error_type", [(500, "InternalServerError"), (400, "BadRequestError")])
def test_model_error_ends_on_error(client, worker, spec, status, error_type):
    s = spec([{"status": status, "error": "scripted outage"}], model_params={"max_retries": 0})
    result = run(client, s)
    assert (result.status, result.exit) == (Status.failed, "error")
    assert result.error_type == error_type and "scripted outage" in result.error
    assert result.iterations == 1


def test_unreachable_model_is_an_error(client, worker):
    result = run(client, {"prompt": "x", "model": "openai/none",
                          "model_params": {"api_base": "http://127.0.0.1:9/v1", "api_key": "sk-own",
                                           "max_retries": 0}})  # fmt: skip
    assert (result.exit, result.status) == ("error", Status.failed)
    assert result.error_type and "onnect" in result.error  # litellm's wording of a refused connection


# -- failed records are fed back, the run goes on ---------------------------------------------
@pytest.mark.parametrize(
    "request_, error_start",
    [
        (call("nope", {"a": 1}), "UnknownTool: no tool named 'nope'"),
        ({"name": "add", "arguments": '{"a": 1,'}, "InvalidArguments: arguments are not valid JSON"),
        (call("add", {"a": "x", "b": 2}), "ValidationError: a: Input should be a valid integer"),
        (call("add", {"a": 1, "b": 2, "c": 3}), "ValidationError: c: Extra inputs"),
        (call("boom", {"message": "kaput"}), "RuntimeError: kaput"),
    ],
)
def test_failed_call_is_recorded_and_fed_back(client, worker, spec, model_server, request_, error_start):
    s = spec([tools(request_), {"content": "recovered"}], tools=["add", "boom"])
    result = run(client, s)
    assert (result.status, result.content) == (Status.completed, "recovered")
    [record] = result.tool_calls
    assert not record.success and record.output is None
    assert record.error.startswith(error_start), record.error
    fed_back = model_server.calls(s["model"])[1]["messages"][-1]
    assert fed_back["role"] == "tool" and fed_back["content"] == f"Error: {record.error}"


def test_registered_tool_outside_the_spec_is_unknown(client, worker, spec):
    result = run(client, spec([tools(call("add", {"a": 1, "b": 2})), {"content": "ok"}], tools=["boom"]))
    assert result.tool_calls[0].error.startswith("UnknownTool")


def test_hung_tool_is_cut_at_its_limit(client, worker, spec):
    s = spec([tools(call("sleepy", {"seconds": 30})), {"content": "moved on"}], tools=["sleepy"],
             tool_timeout_s=2)  # fmt: skip
    started = time.monotonic()
    result = run(client, s, timeout=25)
    assert time.monotonic() - started < 10
    assert (result.status, result.content) == (Status.completed, "moved on")
    [record] = result.tool_calls
    assert not record.success and record.error.startswith("Timeout") and 1900 < record.duration_ms < 6000


def test_two_calls_in_one_turn_keep_the_models_order(client, worker, spec, model_server):
    s = spec([tools(call("sleepy", {"seconds": 0.6}, "c-slow"), call("add", {"a": 1, "b": 2}, "c-fast")),
              {"content": "both"}], tools=["add", "sleepy"])  # fmt: skip
    result = run(client, s)
    assert [r.call_id for r in result.tool_calls] == ["c-slow", "c-fast"]
    assert [r.output for r in result.tool_calls] == ["slept 0.6", 3]
    fed = [m for m in model_server.calls(s["model"])[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in fed] == ["c-slow", "c-fast"]


def test_a_str_output_reaches_the_model_as_it_is_other_values_as_json(client, worker, spec, model_server):
    """A file's lines stay lines in the tool message; an int or a dict is sent as JSON. The
    records keep each output's JSON type either way."""
    lines = 'alpha\n  "beta"\n\tgamma\n'
    s = spec([tools(call("write_file", {"path": "notes.txt", "content": lines}, "c-write")),
              tools(call("read_file", {"path": "notes.txt"}, "c-read"), call("count", {"n": 1}, "c-count")),
              {"content": "read"}], tools=["write_file", "read_file", "count"])  # fmt: skip
    result = run(client, s)
    assert (result.status, result.content) == (Status.completed, "read")
    assert [r.output for r in result.tool_calls] == [len(lines), lines, {"n": 2, "pad": ""}]
    requests = model_server.calls(s["model"])
    fed = {m["tool_call_id"]: m["content"] for r in requests for m in r["messages"] if m["role"] == "tool"}
    assert fed == {"c-write": str(len(lines)), "c-read": lines, "c-count": '{"n": 2, "pad": ""}'}


def test_tokens_add_up_over_turns(client, worker, spec):
    steps = [tools(call("add", {"a": 1, "b": 1}), tokens=11), tools(call("add", {"a": 2, "b": 2}), tokens=23),
             {"content": "done", "tokens": 7}]  # fmt: skip
    result = run(client, spec(steps, tools=["add"]))
    assert result.tokens_used == 41 and result.iterations == 3


def test_outputs_keep_their_json_type_or_become_str(client, worker, spec):
    result = run(client, spec([tools(call("odd_output")), {"content": "ok"}], tools=["odd_output"]))
    assert result.tool_calls[0].output == "{1, 2}"


def test_context_is_injected_and_hidden_from_the_model(client, worker, spec, model_server):
    import os
    import uuid
    from pathlib import Path

    folder = Path(os.environ["TOOLOOP_SANDBOX_ALLOW"], f"given-{uuid.uuid4().hex[:6]}")  # an allowed root
    s = spec([tools(call("where")), {"content": "ok"}], tools=["where"],
             context={"sandbox_root": str(folder), "resource_bindings": {"db": "postgres://x"}})  # fmt: skip
    result = run(client, s)
    output = result.tool_calls[0].output
    assert output["sandbox_root"] == str(folder) and output["bindings"] == {"db": "postgres://x"}
    assert output["cwd"] == str(folder) and folder.is_dir()
    schema = model_server.calls(s["model"])[0]["tools"][0]["function"]["parameters"]
    assert schema["properties"] == {}
    assert result.tool_calls[0].inputs == {}


def test_default_run_folder_is_under_sandbox_root(client, worker, spec):
    import os

    result = run(client, spec([tools(call("where")), {"content": "ok"}], tools=["where"]))
    expected = os.path.join(os.environ["TOOLOOP_SANDBOX_ROOT"], result.run_id)
    assert result.tool_calls[0].output["sandbox_root"] == expected


def test_tool_processes_never_import_litellm(client, worker, spec):
    result = run(client, spec([tools(call("modules")), {"content": "ok"}], tools=["modules"]))
    assert result.tool_calls[0].success and result.tool_calls[0].output == []


# -- refusal and catalog ---------------------------------------------------------------
def _footprint(stack, store) -> tuple[int, int]:
    keys = sum(1 for _ in store.redis.scan_iter(f"{store.keys.prefix}:run:*", count=1000))
    return keys, stack.queued(store.keys.turn_queue)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"prompt": "  "}, "prompt"),
        ({"max_iterations": 0}, "max_iterations"),
        ({"surprise": 1}, "surprise: unknown field"),
        ({"outcome": {"enum": ["ok", "error"]}}, "outcome.enum"),
        ({"tool_timeout_s": 0}, "tool_timeout_s"),
        ({"token_budget": 0}, "token_budget"),
        ({"tools": ["no_such_tool"]}, "tools"),
    ],
)
def test_bad_spec_is_refused_and_nothing_is_written(client, worker, spec, store, stack, fields, named):
    before = _footprint(stack, store)
    with pytest.raises(SpecError) as err:
        client.submit({**spec([{"content": "x"}]), **fields})
    assert named in str(err.value)
    assert _footprint(stack, store) == before


def test_literal_api_key_is_sealed_at_rest(client, worker, spec, store):
    handle = client.submit(spec([{"content": "ok"}], model_params={"api_key": "sk-very-secret"}))
    assert handle.wait(timeout=30).status == Status.completed
    raw = store.redis.hget(store.keys.run(handle.run_id), "spec").decode()
    assert "sk-very-secret" not in raw and json.loads(raw)["model_params"]["api_key"].startswith("sealed:")


def test_catalog_lists_workers_tools_with_schemas(store, worker):
    catalog = store.catalog()
    assert {"add", "shell", "read_file", "write_file", "list_dir"} <= set(catalog)
    assert catalog["add"]["parameters"]["required"] == ["a", "b"]


def test_model_calls_stream_only_when_the_spec_says_so(client, worker, spec, model_server):
    steps = [tools(call("add", {"a": 4, "b": 5}), tokens=17), {"content": "nine", "tokens": 13}]
    plain = spec(steps, tools=["add"])
    streamed = spec(steps, tools=["add"], model_params={"stream": True})
    for s in (plain, streamed):
        result = run(client, s)
        assert (result.content, result.tokens_used, result.tool_calls[0].output) == ("nine", 30, 9)
    assert not any(r.get("stream") for r in model_server.calls(plain["model"]))
    assert all(r.get("stream") for r in model_server.calls(streamed["model"]))
