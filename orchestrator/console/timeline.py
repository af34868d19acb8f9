"""A run as the console shows it: header, turns, calls and control events, from Redis.

Everything comes from what the run already keeps, never from a copy made for the console:

- the run's state hash (status, totals, budgets, the final answer or error);
- the history (``messages``): each recorded turn pushes exactly one assistant message, in
  the same script that sets ``iteration``, so the last assistant message is turn
  ``iteration`` and the ones before it the turns before (compaction removes old ones from
  the front: those turns keep their calls and lose only their text);
- the call records (``calls``, ``<iteration>.<index>``: bounded and scrubbed when written),
  and, for the current turn, the calls the reply asked for and their approval records;
- the event stream (capped): tokens per turn, control events, approvals, recoveries.

Only scrubbed fields are read: a stored reply's ``content`` and tool-call arguments (as
``worker/protect.py`` stores them), never a sealed field of a message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from orchestrator.bounds import RECORD_INPUTS_MAX_BYTES, cut_text
from orchestrator.console.feed import read as read_feed
from orchestrator.keys import parse_call_key
from orchestrator.scrub import scrub_text

if TYPE_CHECKING:
    from orchestrator.store import RunStore

ENDED = ("completed", "failed", "aborted")
PROMPT_SHOWN = 4000  # characters of the prompt in the run header
PRETTY_FROM = 100  # characters of JSON past which a value is shown indented
OPERATOR_STEER = "Guidance from your operator."  # orchestrator/store.py steer_message's first words


@dataclass
class Note:
    """A control event in place on the timeline."""

    kind: str  # control | approval | recovery | compaction | steer | ...
    text: str
    ts: datetime | None = None


@dataclass
class CallView:
    key: str
    call_id: str
    tool: str
    inputs: str
    output: str | None = None
    success: bool | None = None  # None: not recorded yet
    error: str | None = None
    duration_ms: float | None = None
    worker: str | None = None  # the Celery node that ran it
    waiting: bool = False  # waits for a person's decision
    approval: dict[str, Any] | None = None  # the approval record, when the call was gated
    child: str | None = None  # the child run a call of a child agent started

    @property
    def state(self) -> str:
        if self.success is not None:
            return "ok" if self.success else "error"
        if self.child:
            return "waiting for its child run"
        return "waiting for approval" if self.waiting else "running"


@dataclass
class TurnView:
    iteration: int
    text: str | None = None
    calls: list[CallView] = field(default_factory=list)
    tokens: int | None = None  # what this turn's reply added to tokens_used
    cost_usd: float | None = None
    ts: datetime | None = None  # when its reply was recorded
    notes: list[Note] = field(default_factory=list)  # control events during this turn
    guidance: list[Note] = field(default_factory=list)  # steer texts the model saw first
    pending: bool = False  # the turn in flight: no reply recorded yet
    streamed: str = ""  # the model's streamed text so far (a spec with model_params.stream)
    corrected: bool = False  # its reply did not parse; a corrective message followed


@dataclass
class RunView:
    run_id: str
    status: str
    exit: str | None
    model: str
    agent: str | None
    prompt: str
    iteration: int
    max_iterations: int | None
    tokens_used: int
    token_budget: int | None
    cost_usd: float
    cost_budget_usd: float | None
    created_at: int | None
    started_at: int | None
    ended_at: int | None
    error: str | None
    error_type: str | None
    content: str | None
    result: str | None
    outcome: list[str]
    waiting: int  # calls waiting for approval
    turns: list[TurnView]
    start_notes: list[Note]
    last_event_id: str
    parent: dict[str, Any] | None = None  # child runs: set when the run's state names them
    children: list[str] = field(default_factory=list)
    forked_from: dict[str, Any] | None = None  # a fork: its parent and the turn it was made at

    @property
    def ended(self) -> bool:
        return self.status in ENDED


# -- reading -------------------------------------------------------------------------------
def load(store: RunStore, run_id: str, since: int = 0) -> RunView | None:
    """The run's page data, from four reads in one round trip and its event stream; the
    calls of turns before ``since`` are left out (a live fragment shows the last turns)."""
    keys = store.keys
    pipe = store.redis.pipeline(transaction=False)
    pipe.hgetall(keys.run(run_id))
    pipe.lrange(keys.messages(run_id), 0, -1)
    pipe.hgetall(keys.calls(run_id))
    pipe.hgetall(keys.approvals(run_id))
    raw_state, raw_messages, raw_calls, raw_approvals = pipe.execute()
    if not raw_state:
        return None
    state = {_s(k): _s(v) for k, v in raw_state.items()}
    messages = [json.loads(m) for m in raw_messages]
    calls = {_s(k): json.loads(v) for k, v in raw_calls.items() if parse_call_key(_s(k))[0] >= since}
    approvals = {_s(k): json.loads(v) for k, v in raw_approvals.items() if not _s(k).startswith("id:")}
    return build(run_id, state, messages, calls, approvals, read_feed(store, run_id), since)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- building (pure) -------------------------------------------------------------------------
def build(run_id: str, state: dict[str, str], messages: list[dict[str, Any]],
          calls: dict[str, dict[str, Any]], approvals: dict[str, dict[str, Any]],
          events: list[dict[str, Any]], since: int = 0) -> RunView:  # fmt: skip
    """``since``: ``calls`` holds the records of turns from ``since`` on only."""
    spec = _spec(state.get("spec", ""))
    iteration = int(state.get("iteration") or 0)
    turns = {n: TurnView(n) for n in range(1, iteration + 1)}
    replies, guidance = _replies(messages, iteration)
    for n, reply in replies.items():
        turns[n].text = _text(reply.get("content"))
    for n, notes in guidance.items():
        _turn(turns, n).guidance += notes
    _place_calls(turns, {n: r for n, r in replies.items() if n >= since}, calls, approvals)
    start_notes = _place_events(turns, events, approvals)
    status = state.get("status", "queued")
    if status not in ENDED:
        _turn(turns, iteration + 1)  # the turn in flight, where streamed text appears
    for n, turn in turns.items():
        turn.pending = n > iteration
    parent = _json(state.get("parent"))
    children = [str(c) for c in (_json(state.get("children")) or [])]
    _link_children(run_id, turns, children)
    return RunView(
        run_id=run_id, status=status, exit=state.get("exit") or None,
        model=str(spec.get("model", "?")), agent=agent_of(spec),
        prompt=cut_text(scrub_text(str(spec.get("prompt", ""))), PROMPT_SHOWN),
        iteration=iteration, max_iterations=spec.get("max_iterations"),
        tokens_used=int(state.get("tokens_used") or 0), token_budget=spec.get("token_budget"),
        cost_usd=float(state.get("cost_usd") or 0), cost_budget_usd=spec.get("cost_budget_usd"),
        created_at=_int(state.get("created_at")), started_at=_int(state.get("started_at")),
        ended_at=_int(state.get("ended_at")),
        error=state.get("error") or None, error_type=state.get("error_type") or None,
        content=state.get("content") or None, result=_pretty_json(state.get("result")),
        outcome=list((spec.get("outcome") or {}).get("enum", [])),
        waiting=sum(1 for a in approvals.values() if a.get("state") == "pending"),
        turns=[turns[n] for n in sorted(turns)], start_notes=start_notes,
        last_event_id=events[-1]["id"] if events else "0",
        parent=parent if isinstance(parent, dict) else None,
        children=children,
        forked_from=forked if isinstance(forked := _json(state.get("forked_from")), dict) else None,
    )  # fmt: skip


def _link_children(run_id: str, turns: dict[int, TurnView], children: list[str]) -> None:
    """Each call of a child agent names the child run it started (orchestrator/children.py)."""
    if not children:
        return
    from orchestrator.children import child_id

    started = set(children)
    for turn in turns.values():
        for call in turn.calls:
            if call.tool.startswith("agent__") and (made := child_id(run_id, call.key)) in started:
                call.child = made


def _spec(raw: str) -> dict[str, Any]:
    """The stored spec, read without validating it: a page must show whatever is there."""
    try:
        spec = json.loads(raw)
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def agent_of(spec: dict[str, Any]) -> str | None:
    """The agent folder a spec's steering files or skills come from (``agents/<name>/...``)."""
    for path in [*(spec.get("steering_files") or []), *(spec.get("skills") or [])]:
        parts = str(path).replace("\\", "/").split("/")
        for kind in ("steering", "skills"):
            if kind in parts and parts.index(kind) >= 1:
                return parts[parts.index(kind) - 1]
    return None


def _replies(messages: list[dict[str, Any]], iteration: int
             ) -> tuple[dict[int, dict[str, Any]], dict[int, list[Note]]]:  # fmt: skip
    """Assistant messages by turn (counted back from the last, turn ``iteration``), and the
    guidance (operator steers, supervisor or judge messages) each turn's model saw first."""
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    replies = {iteration - k: messages[i] for k, i in enumerate(reversed(assistant))}
    first_turn = iteration - len(assistant) + 1
    guidance: dict[int, list[Note]] = {}
    turn, seen_user = first_turn, False
    for message in messages:
        role, text = message.get("role"), _text(message.get("content")) or ""
        if role == "assistant":
            turn += 1
            continue
        if role == "user" and not seen_user:
            seen_user = True  # the prompt itself
            continue
        if role == "system" and text.startswith(OPERATOR_STEER):
            guidance.setdefault(turn, []).append(Note("steer", text.split("\n", 1)[-1]))
        elif role == "user" and text.startswith(("[supervisor]", "[judge]")):
            guidance.setdefault(turn, []).append(Note("supervisor", text))
    return {n: m for n, m in replies.items() if n >= 1}, guidance


def _place_calls(turns: dict[int, TurnView], replies: dict[int, dict[str, Any]],
                 calls: dict[str, dict[str, Any]], approvals: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    """Recorded calls from their records; the calls a reply asked for and not yet recorded
    (the current turn's) from the reply itself, with their approval state."""
    for key, record in sorted(calls.items(), key=lambda kv: parse_call_key(kv[0])):
        n, _ = parse_call_key(key)
        _turn(turns, n).calls.append(_recorded(key, record, approvals.get(key)))
    for n, reply in replies.items():
        for index, call in enumerate(reply.get("tool_calls") or []):
            key = f"{n}.{index}"
            if key in calls:
                continue
            fn = call.get("function") or {}
            approval = approvals.get(key)
            turns[n].calls.append(CallView(
                key=key, call_id=str((approval or {}).get("call_id") or call.get("id") or key),
                tool=str(fn.get("name", "?")), inputs=_inputs_text(fn.get("arguments")),
                waiting=(approval or {}).get("state") == "pending", approval=approval,
            ))  # fmt: skip
        turns[n].calls.sort(key=lambda c: parse_call_key(c.key))


def _recorded(key: str, record: dict[str, Any], approval: dict[str, Any] | None) -> CallView:
    output = record.get("output")
    return CallView(
        key=key, call_id=str(record.get("call_id", key)), tool=str(record.get("tool_name", "?")),
        inputs=_pretty(record.get("inputs")),
        output=None if output is None and not record.get("success") else _shown_output(output),
        success=bool(record.get("success")), error=record.get("error"),
        duration_ms=record.get("duration_ms"), worker=record.get("worker"), approval=approval,
    )  # fmt: skip


def _place_events(turns: dict[int, TurnView], events: list[dict[str, Any]],
                  approvals: dict[str, dict[str, Any]]) -> list[Note]:  # fmt: skip
    """Tokens and cost per turn from ``iteration`` events; other events as notes, in the
    turn they happened in (the last turn whose reply was recorded, before the first: the
    run's start). Returns the start's notes."""
    start: list[Note] = []
    current, previous = 0, None  # previous iteration event: (iteration, tokens_used, cost_usd)
    for event in events:
        kind, n = event.get("type"), event.get("iteration")
        if kind == "iteration" and isinstance(n, int):
            turn = _turn(turns, n)
            turn.ts, turn.corrected = event.get("ts"), bool(event.get("corrected"))
            tokens, cost = event.get("tokens_used"), event.get("cost_usd")
            cost = float(cost) if isinstance(cost, int | float) else None
            if isinstance(tokens, int) and (n == 1 or (previous and previous[0] == n - 1)):
                turn.tokens = tokens - (previous[1] if previous else 0)
                if isinstance(cost, float):
                    turn.cost_usd = max(0.0, cost - (previous[2] if previous and previous[2] else 0.0))
            previous, current = (n, tokens or 0, cost if isinstance(cost, float) else None), n
            continue
        if kind == "text" and isinstance(n, int):
            _turn(turns, n).streamed += str(event.get("text", ""))
            continue
        note = describe(event)
        if note is None:
            continue
        where = n if isinstance(n, int) and kind != "outcome" else current
        if where:
            _turn(turns, where).notes.append(note)
        else:
            start.append(note)
        if kind == "approval" and event.get("decision") == "pending":
            _approval_inputs(turns, event)
    return start


def _approval_inputs(turns: dict[int, TurnView], event: dict[str, Any]) -> None:
    """A waiting call shows the arguments its approval event carries (scrubbed, bounded as
    in a record): what the person decides on."""
    for call in turns.get(event.get("iteration") or 0, TurnView(0)).calls:
        if call.call_id == event.get("call_id") and call.success is None and event.get("arguments"):
            call.inputs = _inputs_text(event["arguments"])


def describe(event: dict[str, Any]) -> Note | None:
    """A control event as one line; None for those the timeline shows as structure."""
    kind, ts = str(event.get("type", "?")), event.get("ts")
    by = f" by {event['by']}" if event.get("by") else ""
    if kind in ("iteration", "tool_call", "text", "outcome", "queued"):
        return None
    if kind == "control":
        action = event.get("action", "?")
        if action == "steer_applied":
            return Note("steer", f"{event.get('count', 1)} steer message(s) reached the model", ts)
        return Note("control", f"{action}{by}", ts)
    if kind == "approval":
        decision = event.get("decision", "?")
        reason = f": {event['reason']}" if event.get("reason") and decision == "denied" else ""
        call = f"{event.get('tool', '?')} ({event.get('call_id', '?')})"
        return Note("approval", f"approval {decision} for {call}{by}{reason}", ts)
    if kind == "recovery":
        return Note("recovery", f"recovered: {event.get('step', '?')} sent again to a live worker", ts)
    if kind == "compaction":
        sizes = f"{event.get('before')} -> {event.get('after')} messages"
        return Note("compaction", f"history compacted: {sizes}", ts)
    if kind == "rate_limited":
        return Note("rate_limited", f"rate limited: waited {event.get('wait_ms')} ms", ts)
    if kind == "waiting":
        return Note("waiting", f"waiting for its tenant's share ({event.get('reason', '?')})", ts)
    if kind == "admitted":
        waited = event.get("waited_ms")
        return Note("admitted", f"admitted after waiting {waited} ms for its tenant's share", ts)
    if kind == "forked":
        model = f", on {event['model']}" if event.get("model") else ""
        appended = ", with an appended instruction" if event.get("prompt_appended") else ""
        return Note("forked", f"forked from {event.get('parent', '?')} at turn {event.get('iteration', '?')}"
                    f"{model}{appended}{by}", ts)  # fmt: skip
    if kind == "fork_warning":
        calls, at, tools = event.get("calls", "?"), event.get("iteration", "?"), event.get("tools", "?")
        return Note("fork_warning", f"warning: {calls} call(s) before turn {at} were not idempotent "
                    f"({tools}): they ran for the parent only; this fork's sandbox folder started empty",
                    ts)  # fmt: skip
    if kind == "discarded":
        return Note("discarded", f"a late reply was discarded ({event.get('tokens')} tokens billed)", ts)
    skip = {"type", "ts", "id", "iteration"}
    details = " ".join(f"{k}={v}" for k, v in event.items() if k not in skip)
    return Note(kind, f"{kind} {details}".strip(), ts)


def _turn(turns: dict[int, TurnView], n: int) -> TurnView:
    if n not in turns:
        turns[n] = TurnView(n)
    return turns[n]


# -- values ------------------------------------------------------------------------------------
def _text(content: Any) -> str | None:
    if content is None or content == "":
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict)) or None
    return json.dumps(content)


def _inputs_text(arguments: Any) -> str:
    """A call's arguments as the reply stored them (scrubbed), bounded like a record's."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return cut_text(arguments, RECORD_INPUTS_MAX_BYTES)
    return cut_text(_pretty(arguments), RECORD_INPUTS_MAX_BYTES)


def _shown_output(output: Any) -> str:
    """A ``str`` output as it is (a file's lines stay lines); other values as JSON."""
    return output if isinstance(output, str) else _pretty(output)


def _pretty(value: Any) -> str:
    """JSON on one line when short, indented when long (the indenting encoder is pure Python:
    a 500-turn page pays for it only where it helps)."""
    compact = json.dumps(value, ensure_ascii=False)
    return compact if len(compact) <= PRETTY_FROM else json.dumps(value, indent=2, ensure_ascii=False)


def _pretty_json(raw: str | None) -> str | None:
    value = _json(raw)
    return None if value is None else _shown_output(value)


def _json(raw: str | None) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None
