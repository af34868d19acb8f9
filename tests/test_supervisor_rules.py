"""The supervisor's pure logic: rules, loop detectors, the judge's brief and verdict."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from orchestrator import supervisor as sv
from orchestrator.models import JudgeSpec, RunSpec, SupervisorRule, SupervisorSpec


# -- helpers ------------------------------------------------------------------------
def call(tool: str = "add", args: dict | str | None = None, result: str | None = None) -> sv.Call:
    raw = args if isinstance(args, str) else json.dumps(args or {"a": 1, "b": 2})
    return sv.Call(tool, sv.canonical_arguments(raw), result)


def view(calls=(), iteration: int = 1, tokens: int = 0, budget: int | None = None) -> sv.LoopView:
    return sv.LoopView(iteration, tokens, budget, 25, tuple(calls))


def spec(*rules: dict, **fields) -> SupervisorSpec:
    return SupervisorSpec(rules=[SupervisorRule(**r) for r in rules], **fields)


def fired(sup: SupervisorSpec, v: sv.LoopView) -> list[tuple[str, str]]:
    return [(f.rule, f.action) for f in sv.evaluate(sup, v)]


# -- the view --------------------------------------------------------------------------
def test_calls_from_messages_pairs_results_and_appends_this_turn():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "x"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "Error: boom"},
        {"role": "system", "content": "Guidance from your operator ..."},
        {"role": "user", "content": "[judge] An automated judge ... found a problem: ..."},
    ]  # fmt: skip
    calls = sv.calls_from_messages(messages, [("add", '{"a":1,"b":2}')])
    assert calls == (
        sv.Call("add", '{"a":1,"b":2}', "3"),
        sv.Call("lookup", '{"key":"x"}', "Error: boom"),
        sv.Call("add", '{"a":1,"b":2}', None),
    )
    assert [c.failed for c in calls] == [False, True, False]


def test_canonical_arguments_ignores_spacing_and_key_order_keeps_bad_json():
    assert sv.canonical_arguments('{ "b":2,  "a":1 }') == sv.canonical_arguments('{"a":1,"b":2}')
    assert sv.canonical_arguments("") == "{}"
    assert sv.canonical_arguments("{not json") == "{not json"


# -- tool_repeated ---------------------------------------------------------------------
def test_tool_repeated_needs_count_identical_calls_in_a_row():
    sup = spec({"when": "tool_repeated", "then": "abort"}, detect_loops=False)
    assert fired(sup, view([call(), call()])) == []
    assert fired(sup, view([call(), call(), call()])) == [("tool_repeated", "abort")]
    # different arguments, or another call in between, break the row
    assert fired(sup, view([call(), call(args={"a": 2, "b": 2}), call()])) == []
    assert fired(sup, view([call(), call(), call("lookup"), call()])) == []


def test_tool_repeated_counts_this_turns_calls_without_results():
    sup = spec({"when": "tool_repeated", "count": 2, "then": "steer"}, detect_loops=False)
    assert fired(sup, view([call(result="3"), call()])) == [("tool_repeated", "steer")]


def test_tool_repeated_with_tool_only_counts_that_tool():
    sup = spec({"when": "tool_repeated", "tool": "lookup", "then": "pause"}, detect_loops=False)
    assert fired(sup, view([call()] * 5)) == []
    three = [call("lookup", {"key": "k"})] * 3
    assert fired(sup, view(three)) == [("tool_repeated", "pause")]


def test_tool_repeated_default_text_names_the_tool_not_the_arguments():
    sup = spec({"when": "tool_repeated", "tool": "lookup", "then": "steer"}, detect_loops=False)
    (firing,) = sv.evaluate(sup, view([call("lookup", {"key": "SECRETARG"})] * 3))
    assert "lookup" in firing.message and "SECRETARG" not in firing.message
    assert firing.key == "rule:0"


# -- budget_fraction / iteration_reached ------------------------------------------------
def test_budget_fraction_is_strictly_greater_and_inert_without_budget():
    sup = spec({"when": "budget_fraction", "gt": 0.5, "then": "steer"}, detect_loops=False)
    assert fired(sup, view(tokens=50, budget=100)) == []
    assert fired(sup, view(tokens=51, budget=100)) == [("budget_fraction", "steer")]
    assert fired(sup, view(tokens=10_000, budget=None)) == []


def test_budget_fraction_default_is_80_percent():
    sup = spec({"when": "budget_fraction", "then": "pause"}, detect_loops=False)
    assert fired(sup, view(tokens=80, budget=100)) == []
    assert fired(sup, view(tokens=81, budget=100)) == [("budget_fraction", "pause")]


def test_iteration_reached_holds_from_gte_on():
    sup = spec({"when": "iteration_reached", "gte": 3, "then": "abort"}, detect_loops=False)
    assert fired(sup, view(iteration=2)) == []
    assert fired(sup, view(iteration=3)) == [("iteration_reached", "abort")]
    assert fired(sup, view(iteration=7)) == [("iteration_reached", "abort")]


def test_rule_message_overrides_default_and_abort_reason_names_the_rule():
    sup = spec({"when": "iteration_reached", "gte": 1, "then": "abort", "message": "enough"},
               {"when": "iteration_reached", "gte": 1, "then": "steer"}, detect_loops=False)  # fmt: skip
    first, second = sv.evaluate(sup, view(iteration=1))
    assert first.message == "enough" and "turn 1 of at most 25" in second.message
    assert (first.key, second.key) == ("rule:0", "rule:1")
    assert "iteration_reached" in sv.abort_reason(first)


# -- loop detectors --------------------------------------------------------------------
def test_loop_repeat_needs_the_same_result_and_ignores_this_turn():
    sup = spec()  # detectors on by default, count 3, steer
    same = [call(result="3")] * 3
    assert fired(sup, view(same)) == [("loop_repeat", "steer")]
    changing = [call(result="1"), call(result="2"), call(result="3")]
    assert fired(sup, view(changing)) == []
    # this turn's calls have no result yet: they do not count
    assert fired(sup, view([call(result="3"), call(result="3"), call()])) == []


def test_pingpong_two_calls_alternating_with_same_results():
    a, b = call("add", result="3"), call("lookup", {"key": "k"}, result='"K"')
    sup = spec(loop_count=2, loop_action="pause")
    assert fired(sup, view([a, b, a])) == []
    assert fired(sup, view([a, b, a, b])) == [("loop_pingpong", "pause")]
    assert fired(sup, view([a, b, a, call("add", result="4")])) == []
    # three distinct calls cycling are not a ping-pong
    c = call("where", result="{}")
    assert fired(sup, view([a, b, c, a, b, c])) == []


@pytest.mark.parametrize(
    ("sigs", "longest"),
    [("", 0), ("A", 1), ("AA", 1), ("AB", 2), ("ABA", 3), ("ABAB", 4), ("ABAA", 3), ("AABAB", 4),
     ("ABCBCB", 5), ("ABAC", 3)],
)  # fmt: skip
def test_longest_pingpong(sigs: str, longest: int):
    calls = [call(s, result="r") for s in sigs]
    assert sv.longest_pingpong(calls) == longest


def test_detect_loops_off():
    sup = spec(detect_loops=False)
    assert fired(sup, view([call(result="3")] * 10)) == []


# -- the judge ---------------------------------------------------------------------------
def test_judge_brief_has_metadata_only():
    calls = [call("lookup", {"key": "SECRETARG"}, "SECRETOUT")] * 2 + [call("add", result="Error: x")]
    brief = sv.judge_brief(view(calls, iteration=4, tokens=120, budget=1000))
    assert brief == {
        "iteration": 4, "max_iterations": 25, "tokens_used": 120, "token_budget": 1000,
        "tool_calls": 3, "failed_tool_calls": 1, "calls_by_tool": {"lookup": 2, "add": 1},
        "recent_tools": ["lookup", "lookup", "add"],
    }  # fmt: skip
    text = json.dumps(sv.judge_messages(brief))
    assert "SECRETARG" not in text and "SECRETOUT" not in text


@pytest.mark.parametrize(
    ("content", "verdict"),
    [
        ('{"passed": true, "reason": "fine"}', sv.Verdict(True, "fine")),
        ('```json\n{"passed": false, "reason": "stuck"}\n```', sv.Verdict(False, "stuck")),
        ('{"passed": false}', sv.Verdict(False, "no reason given")),
    ],
)
def test_parse_verdict(content: str, verdict: sv.Verdict):
    assert sv.parse_verdict(content) == verdict


@pytest.mark.parametrize("content", ["", "yes", "[true]", '{"passed": "yes"}', '{"reason": "x"}', None])
def test_parse_verdict_refuses(content):
    with pytest.raises(sv.JudgeError):
        sv.parse_verdict(content)


def test_long_reason_is_cut():
    verdict = sv.parse_verdict(json.dumps({"passed": False, "reason": "x" * 5000}))
    assert len(verdict.reason) == sv.REASON_CHARS


# -- the spec ------------------------------------------------------------------------------
def test_contract_example_parses():
    sup = SupervisorSpec.model_validate({
        "rules": [{"when": "tool_repeated", "count": 3, "then": "abort"},
                  {"when": "budget_fraction", "gt": 0.8, "then": "steer", "message": "Wrap up now."}],
        "judge": {"model": "openai/gpt-4o-mini", "every_n_iterations": 2, "on_judge_error": "ignore"},
    })  # fmt: skip
    assert sup.judge and sup.judge.timeout_s == 30
    assert [r.when for r in sup.rules] == ["tool_repeated", "budget_fraction"]


@pytest.mark.parametrize(
    ("rule", "complaint"),
    [
        ({"when": "iteration_reached", "then": "abort"}, "needs `gte`"),
        ({"when": "budget_fraction", "then": "abort", "count": 5}, "`count` does not apply"),
        ({"when": "tool_repeated", "then": "abort", "gte": 3}, "`gte` does not apply"),
        ({"when": "tool_repeated", "then": "explode"}, "then"),
        ({"when": "budget_fraction", "then": "steer", "gt": 1.5}, "gt"),
        ({"when": "tool_repeated", "then": "steer", "message": "  "}, "blank"),
        ({"when": "tool_repeated", "then": "steer", "cnt": 3}, "cnt"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(rule: dict, complaint: str):
    with pytest.raises(ValidationError, match=complaint):
        RunSpec(prompt="p", model="m", supervisor={"rules": [rule]})


def test_spec_survives_the_round_trip_through_redis():
    # the store keeps model_dump_json(): every field explicit, so "set" is not "given"
    rules = [
        {"when": w, "then": "steer", **extra}
        for w, extra in [
            ("tool_repeated", {"tool": "add"}),
            ("budget_fraction", {}),
            ("iteration_reached", {"gte": 2}),
        ]
    ]
    spec = RunSpec(prompt="p", model="m", supervisor={"rules": rules, "judge": {"model": "j"}})
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec


def test_judge_literal_api_key_is_sealed_and_bad_error_policy_refused():
    from orchestrator.validation import check_spec

    spec = RunSpec(prompt="p", model="m", supervisor=SupervisorSpec(
        judge=JudgeSpec(model="m", model_params={"api_key": "sk-live"})))  # fmt: skip
    stored = check_spec(spec, None).stored_spec  # TOOLOOP_SECRET_KEY is set by the suite
    assert "sk-live" not in stored.model_dump_json()
    assert stored.supervisor.judge.model_params["api_key"].startswith("sealed:")
    with pytest.raises(ValidationError, match="on_judge_error"):
        JudgeSpec(model="m", on_judge_error="explode")
    assert JudgeSpec(model="m", model_params={"api_key_env": "K"}).on_judge_error == "ignore"


def test_steers_are_marked_with_their_source():
    """An operator's steer is a system message; a supervisor rule's or a judge's is a user
    message marked as theirs, never passed off as the operator's."""
    from orchestrator.store import steer_entry

    operator = steer_entry("Be brief.")
    assert operator["role"] == "system" and operator["content"].startswith("Guidance from your operator")
    assert steer_entry("Be brief.", "judge") == {"role": "user", "content": "[judge] Be brief."}
    assert steer_entry("Stop.", "supervisor") == {"role": "user", "content": "[supervisor] Stop."}
