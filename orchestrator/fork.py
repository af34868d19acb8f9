"""Fork a run at turn N: a new run whose history is the parent's as it stood when turn N
began, whose first turn is N. Nothing before N runs again: no tool call, no model call, no
billing; its ``tokens_used`` and ``cost_usd`` start at what the parent had spent before N.

One read of the parent (a script on its keys: a consistent snapshot, even while it runs),
one write of the fork (a script on the fork's keys, mirroring ``CREATE``), then its turn N
is enqueued. The parent is only read: running or ended, it goes on untouched.

- The history at N comes from the parent's history and its journal (orchestrator/journal.py):
  what compaction took out at turn N or later is put back, then the history is cut where
  turn N began.
- The fork carries the parent's call records and call ids of turns before N (its result
  lists them, as its history holds them), and its journal entries of those turns (so a fork
  of the fork can look back past N).
- ``prompt_append``: a ``user`` message with that text ends the fork's history; ``model``:
  the fork runs that model (checked against the credential rules, as at submit).
- Its sandbox folder is a fresh one (``$TOOLOOP_SANDBOX_ROOT/<fork id>``; a spec's
  ``context.sandbox_root`` is dropped): tooloop does not snapshot folders, and a tool worker's
  folder lives on its own host. When calls before N were not idempotent, a ``fork_warning``
  event says so: their effects happened for the parent, and the fork neither repeats them
  nor has them in its folder.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from orchestrator.bounds import STEER_MAX_CHARS, TooLong, refuse_long
from orchestrator.journal import Journal, history_at
from orchestrator.journal import parse as parse_journal
from orchestrator.keys import parse_call_key, run_id_error, shard_of
from orchestrator.models import ForkedFrom, RunSpec, Status

if TYPE_CHECKING:
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore

# Errors a call that never ran gives: no effect to warn about.
NEVER_RAN = ("ValidationError", "UnknownTool", "InvalidArguments", "Denied", "SecretError", "WorkerLost")

# The parent, read in one step. KEYS: its state, messages, calls, call ids, journal.
READ = """
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1),
        redis.call('HGETALL', KEYS[3]), redis.call('HGETALL', KEYS[4]), redis.call('HGETALL', KEYS[5])}
"""

# The fork, written in one step; its fields mirror CREATE's (orchestrator/scripts.py), with
# the iteration before its first turn, what its parent spent before it, and where it came from.
# KEYS: state, messages, calls, call ids, events, journal, the shard's run index, the
#   tenant's run index, the shard's lease index (all on the fork's hash tag)
# ARGV: run id, spec, tenant, iteration before the first turn, tokens, cost, compaction tokens,
#   forked_from JSON, lease ms, events cap, by, model ('' same), prompt appended (0/1),
#   non-idempotent calls, their tools, then counted lists: messages; (call key, record);
#   (call id, key); (journal field, value)  -> 1 | 0 (the id is taken)
WRITE = """
local RUN, MSGS, CALLS, CALLIDS, EVENTS, JOURNAL, RUNS, TENANT_RUNS, LEASES =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
if redis.call('EXISTS', RUN) == 1 then return 0 end
local clock = redis.call('TIME')
local NOW = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local LEASE, MAXLEN = tonumber(ARGV[9]), ARGV[10]
redis.call('HSET', RUN, 'spec', ARGV[2], 'tenant', ARGV[3],
  'status', 'queued', 'phase', 'turn', 'iteration', ARGV[4], 'tokens_used', ARGV[5],
  'pending', 0, 'ncalls', 0, 'turn_claimed', 0, 'turn_gen', 1, 'turn_taken', 0,
  'turn_attempts', 0, 'turn_owner', '', 'turn_error', '', 'turn_deadline', NOW + LEASE,
  'created_at', NOW, 'updated_at', NOW, 'forked_from', ARGV[8])
if tonumber(ARGV[6]) > 0 then redis.call('HSET', RUN, 'cost_usd', ARGV[6]) end
if tonumber(ARGV[7]) > 0 then redis.call('HSET', RUN, 'tokens_compaction', ARGV[7]) end
local i = 16
local function each(width, fn)
  local n = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, n do fn(i) i = i + width end
end
each(1, function(j) redis.call('RPUSH', MSGS, ARGV[j]) end)
each(2, function(j) redis.call('HSET', CALLS, ARGV[j], ARGV[j + 1]) end)
each(2, function(j) redis.call('HSET', CALLIDS, ARGV[j], ARGV[j + 1]) end)
each(2, function(j) redis.call('HSET', JOURNAL, ARGV[j], ARGV[j + 1]) end)
local function event(kind, ...)
  redis.call('XADD', EVENTS, 'MAXLEN', '~', MAXLEN, '*', 'type', kind, 'ts', NOW, ...)
end
local parent = cjson.decode(ARGV[8])
event('queued')
local fields = {'parent', parent.run_id, 'iteration', parent.iteration, 'by', ARGV[11],
  'prompt_appended', ARGV[13]}
if ARGV[12] ~= '' then fields[#fields + 1] = 'model' fields[#fields + 1] = ARGV[12] end
event('forked', unpack(fields))
if tonumber(ARGV[14]) > 0 then
  event('fork_warning', 'iteration', parent.iteration, 'calls', ARGV[14], 'tools', ARGV[15])
end
redis.call('ZADD', RUNS, NOW, ARGV[1])
redis.call('ZADD', TENANT_RUNS, NOW, ARGV[1])
redis.call('ZADD', LEASES, NOW + LEASE, ARGV[1])
return 1
"""


class ForkError(ValueError):
    """A fork was refused; ``kind``: ``not_found`` (no such run, or another tenant's),
    ``refused`` (a turn it cannot be made at, a bad option), ``spec_refused`` (the model
    given is refused by the credential rules)."""

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Parent:
    """The parent as one read saw it."""

    run_id: str
    state: dict[str, str]
    messages: list[dict[str, Any]]
    calls: dict[str, str]
    call_ids: dict[str, str]
    journal: Journal

    @property
    def iteration(self) -> int:
        return int(self.state.get("iteration") or 0)

    def latest_turn(self) -> int:
        """The last turn a fork may be made at: the one after the last, once it has begun
        (or the run ended); while the last turn's tool calls run, the last."""
        status, phase = self.state.get("status", ""), self.state.get("phase", "")
        ended = status in (Status.completed, Status.failed, Status.aborted)
        return self.iteration + 1 if ended or phase == "turn" else self.iteration


@dataclass
class Plan:
    """What the fork's script writes: a run that starts at turn ``at`` with this history."""

    spec: RunSpec
    history: list[dict[str, Any]]
    at: int
    forked_from: ForkedFrom
    tokens: int = 0
    cost: float = 0.0
    compaction_tokens: int = 0
    calls: dict[str, str] = field(default_factory=dict)  # the parent's records before `at`
    call_ids: dict[str, str] = field(default_factory=dict)
    journal: dict[str, str] = field(default_factory=dict)  # the parent's journal before `at`
    by: str = "operator"
    model: str = ""  # another model than the parent's
    prompt_appended: bool = False
    not_idempotent: list[str] = field(default_factory=list)  # tools of calls before `at`


class Producer(Protocol):
    """What a fork needs of the client that makes it (``orchestrator.client.Client``)."""

    store: RunStore
    settings: Settings

    @property
    def celery(self) -> Any: ...


def fork_run(
    client: Producer,
    run_id: str,
    at: int,
    prompt_append: str | None = None,
    model: str | None = None,
    tenant: str | None = None,
    by: str = "operator",
) -> str:
    """Fork ``run_id`` at turn ``at``; ``tenant``: the caller's (another tenant's run is not
    found). The new run's id; ``ForkError`` when refused, and nothing is written then."""
    from orchestrator.dispatch import enqueue_turn  # (Celery: only when a fork is sent)

    store = client.store
    parent = read_parent(store, run_id, tenant)
    latest = parent.latest_turn()
    if isinstance(at, bool) or not isinstance(at, int) or not 1 <= at <= latest:
        raise ForkError(_range_message(parent, at, latest))
    spec = _fork_spec(parent, model, client)
    history = _history(store, parent, at)
    if prompt_append is not None:
        if not prompt_append.strip():
            raise ForkError("prompt_append must not be blank")
        try:
            refuse_long("prompt_append", prompt_append, STEER_MAX_CHARS)
        except TooLong as exc:
            raise ForkError(str(exc)) from None
        history.append({"role": "user", "content": prompt_append})
    tokens, cost = _spent_before(store, parent, at)
    calls = {k: v for k, v in parent.calls.items() if parent_turn(k) < at}
    plan = Plan(
        spec, history, at, ForkedFrom(run_id=run_id, iteration=at), tokens, cost,
        compaction_tokens=sum(int(c.get("tokens") or 0) for n, entry in parent.journal.turns.items() if n < at
                              for c in entry.get("compactions") or []),
        calls=calls, call_ids={cid: key for cid, key in parent.call_ids.items() if parent_turn(key) < at},
        journal=_journal_fields(parent.journal, at), by=by, prompt_appended=prompt_append is not None,
        model=model if model and model != parent_model(parent) else "",
        not_idempotent=_not_idempotent(store, calls),
    )  # fmt: skip
    fork_id = uuid.uuid4().hex
    if not write(store, fork_id, plan):
        raise ForkError(f"run {fork_id} already exists")
    enqueue_turn(fork_id, at, 1, client.celery)
    return fork_id


def write(store: RunStore, run_id: str, plan: Plan) -> bool:
    """Write the run ``plan`` describes, in one step; False if ``run_id`` is taken. Its turn
    ``plan.at`` is then to be sent at generation 1."""
    args: list[Any] = [
        run_id, plan.spec.model_dump_json(), plan.spec.tenant, plan.at - 1, plan.tokens, f"{plan.cost:.10f}",
        plan.compaction_tokens, plan.forked_from.model_dump_json(), int(store.settings.lease_s * 1000),
        store.settings.events_maxlen, plan.by, plan.model, int(plan.prompt_appended),
        len(plan.not_idempotent), ",".join(sorted(set(plan.not_idempotent))),
    ]  # fmt: skip
    args += [len(plan.history), *(json.dumps(m) for m in plan.history)]
    for pairs in (plan.calls, plan.call_ids, plan.journal):
        args += [len(pairs), *(x for kv in pairs.items() for x in kv)]
    keys, shard = store.keys, shard_of(run_id)
    return bool(_script(store, "WRITE")(keys=[
        keys.run(run_id), keys.messages(run_id), keys.calls(run_id), keys.call_ids(run_id),
        keys.events(run_id), keys.journal(run_id), keys.runs(shard),
        keys.tenant_runs(plan.spec.tenant, shard), keys.leases(shard)], args=args))  # fmt: skip


def parent_turn(call_key: str) -> int:
    return parse_call_key(call_key)[0]


def parent_model(parent: Parent) -> str:
    try:
        return str(json.loads(parent.state.get("spec") or "{}").get("model") or "")
    except ValueError:
        return ""


def read_parent(store: RunStore, run_id: str, tenant: str | None = None) -> Parent:
    """The run's state, history, call records, call ids and journal, read in one step;
    ``ForkError(not_found)`` for no such run, or another tenant's."""
    if run_id_error(run_id):
        raise ForkError(f"no run {run_id!r}", "not_found")
    keys = store.keys
    out = _script(store, "READ")(keys=[keys.run(run_id), keys.messages(run_id), keys.calls(run_id),
                                       keys.call_ids(run_id), keys.journal(run_id)])  # fmt: skip
    state = _pairs(out[0])
    if not state or (tenant is not None and state.get("tenant") != tenant):
        raise ForkError(f"no run {run_id!r}", "not_found")
    return Parent(run_id, state, [json.loads(_s(m)) for m in out[1]], _pairs(out[2]), _pairs(out[3]),
                  parse_journal(_pairs(out[4])))  # fmt: skip


def _range_message(parent: Parent, at: Any, latest: int) -> str:
    turns = parent.iteration
    if latest == turns and turns:
        why = f"turn {turns}'s tool calls are still running, so turn {turns + 1} has not begun"
        return f"--at {at}: a fork is made at a turn that has begun: 1..{latest} ({why})"
    return f"--at {at}: run {parent.run_id} has {turns} turn(s); a fork is made at 1..{latest}"


def _fork_spec(parent: Parent, model: str | None, client: Producer) -> RunSpec:
    """The parent's stored spec (credentials stay sealed for the same tenant), its own folder,
    and the model given, checked as at submit."""
    from orchestrator.validation import check_model_params

    try:
        spec = RunSpec.model_validate_json(parent.state["spec"])
    except ValidationError as exc:
        raise ForkError(f"run {parent.run_id}'s stored spec does not parse: {exc}") from None
    update: dict[str, Any] = {"context": spec.context.model_copy(update={"sandbox_root": None})}
    if model is not None:
        if not model.strip():
            raise ForkError("model must not be empty")
        update["model"] = model
    spec = spec.model_copy(update=update)
    if model is not None:
        errors = check_model_params(spec, client.settings)
        if errors:
            raise ForkError("; ".join(errors), "spec_refused")
    return spec


def _history(store: RunStore, parent: Parent, at: int) -> list[dict[str, Any]]:
    try:
        return history_at(parent.messages, parent.journal, at, _last_reply(store, parent))
    except LookupError as exc:
        raise ForkError(f"--at {at}: {exc}") from None


def _last_reply(store: RunStore, parent: Parent) -> int:
    """The last turn whose reply the history holds: the run's last turn, unless that one
    ended the run without a reply (a model error), as its events tell."""
    last = parent.iteration
    if last == 0 or last in parent.journal.turns:
        return last
    replied = _iteration_events(store, parent.run_id)
    return last if last in replied or not replied else max(replied)


def _iteration_events(store: RunStore, run_id: str) -> dict[int, tuple[int, float]]:
    """Turn -> (tokens used, cost) right after its reply, from the run's (capped) events."""
    out: dict[int, tuple[int, float]] = {}
    for event in store.read_events(run_id, count=store.settings.events_maxlen + 100):
        if event.type == "iteration":
            out[event.iteration] = (event.tokens_used, event.cost_usd)  # type: ignore[attr-defined]
    return out


def _spent_before(store: RunStore, parent: Parent, at: int) -> tuple[int, float]:
    """What the parent had spent when turn ``at`` began."""
    entry = parent.journal.turns.get(at)
    if entry is not None and "tokens_before" in entry:
        return int(entry["tokens_before"]), float(entry.get("cost_before") or 0.0)
    if at == 1:
        return 0, 0.0
    if at > _last_reply(store, parent):  # the turn after the last reply: everything so far
        return int(parent.state.get("tokens_used") or 0), float(parent.state.get("cost_usd") or 0.0)
    seen = _iteration_events(store, parent.run_id)
    if at - 1 in seen:
        return seen[at - 1]
    why = f"the tokens run {parent.run_id} had used before turn {at} are no longer known"
    raise ForkError(f"--at {at}: {why}")


def _journal_fields(parent: Journal, at: int) -> dict[str, str]:
    """The parent's journal entries of turns before ``at``, and its tool sets."""
    def before(name: str) -> bool:
        turn = name[1:].split(".")[0]
        return turn.isdigit() and int(turn) < at

    return {name: value for name, value in parent.raw.items()
            if name.startswith("s") or (name[0] in "tc" and before(name))}  # fmt: skip


def _not_idempotent(store: RunStore, calls: dict[str, str]) -> list[str]:
    """The tools of calls before the fork that ran and are not idempotent (as the live
    catalog says; a tool it does not know, or a declared HTTP tool, is taken as not)."""
    catalog = store.catalog()
    tools = []
    for raw in calls.values():
        record = json.loads(raw)
        error = str(record.get("error") or "")
        if not record.get("success") and error.startswith(NEVER_RAN):
            continue
        name = str(record.get("tool_name") or "?")
        if not (catalog.get(name) or {}).get("idempotent"):
            tools.append(name)
    return tools


def _pairs(flat: list[Any]) -> dict[str, str]:
    return {_s(flat[i]): _s(flat[i + 1]) for i in range(0, len(flat), 2)}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _script(store: RunStore, name: str) -> Any:
    # registered once per store (its Redis client), as orchestrator/approvals.py does
    cache = store.__dict__.setdefault("_fork_scripts", {})
    if name not in cache:
        cache[name] = store.redis.register_script(READ if name == "READ" else WRITE)
    return cache[name]
