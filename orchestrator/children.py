"""Child runs: agents that call agents, on the same fleet, inside their parent's budget.

A spec's ``agents: {name: SPEC}`` offers the model one tool per child agent,
``agent__<name>(prompt)``. A call of it starts a child run: a run like any other (its own
turns on any worker, its own folder ``$TOOLOOP_SANDBOX_ROOT/<child id>``, the same tenant),
whose hash names its parent. This module holds what the control plane knows of them:

- **at submit** (``check_agents``): every child spec, read from its file (relative to the
  spec's folder, or to ``TOOLOOP_AGENTS_DIR``) or given inline, is checked as if it were
  submitted itself, its own children too; a cycle of spec files, or children nested past
  ``max_depth``, is refused, naming the path (``agents.a.agents.b``). The whole tree is
  stored inline in the parent's spec (``Resolved`` entries): workers never read files.
- **the step script** (Lua, on ``scripts.PRELUDE``): ``START_CHILD`` writes the child
  run and parks the parent's call in one step. A child's id is derived from its
  parent's id and the call's key (``child_id``), in its parent's shard, so a call starts
  at most one child however often its message comes, and one script reaches parent and
  child together (one slot of a Redis Cluster). ``scripts.PRELUDE`` does the rest where it happens: a child's
  spend counts into every ancestor's ``tokens_used`` and ``cost_usd`` (``add_usage``); a
  child whose tree's budget is spent ends at its next turn (``CLAIM_TURN``); a run that
  ends aborts its running children and makes its parent's call due within a lease
  (``finish``): whoever ended it records the call at once, else the sweeper sends it.
- **control and reading**: pause and resume reach a run's children (``orchestrator.control``,
  ``paused_children``); ``tree`` lists a run's descendants for ``tooloop status``.

The parent's call waits parked like an approval (call state ``q``, no lease, no worker
slot); the run's hash counts the children it waits for (``children_waiting``). The worker's
side (``worker/children.py``) starts the child and records the call when it ends.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.keys import SHARDS, run_id_error, shard_of
from orchestrator.models import AGENT_TOOL_PREFIX, RunSpec
from orchestrator.spec_report import SpecReport, validation_messages

if TYPE_CHECKING:
    from orchestrator.store import RunStore

# Checks a child spec as if submitted, where its lineage places it (orchestrator.validation's).
CheckChild = Callable[[RunSpec, "RunStore | None", "Lineage"], SpecReport]

RECHECK_S = 600  # a parked call is looked at again this often (its child's end makes it due sooner)
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
PROMPT_GIVEN = "(given by each call)"  # a child spec's prompt while it is checked at submit


# -- names -------------------------------------------------------------------------------------
def tool_name(agent: str) -> str:
    return AGENT_TOOL_PREFIX + agent


def agent_of(tool: object, spec: RunSpec) -> str | None:
    """The child agent a tool name calls in this spec, or None (also for a name that is not
    a string: a model's malformed call is the tool task's to refuse)."""
    if not isinstance(tool, str) or not tool.startswith(AGENT_TOOL_PREFIX):
        return None
    name = tool.removeprefix(AGENT_TOOL_PREFIX)
    return name if name in spec.agents else None


def tool_names(spec: RunSpec) -> list[str]:
    return [tool_name(name) for name in spec.agents]


def tool_schemas(spec: RunSpec) -> list[dict[str, Any]]:
    """The OpenAI tool schemas the model is offered for the spec's child agents."""
    out = []
    for name, entry in spec.agents.items():
        child = entry.get("spec", {}) if isinstance(entry, dict) else {}
        description = child.get("description") or (
            f"Delegate a task to the {name} agent: it works on it in a run of its own, with its "
            "own tools, and its final answer is this call's result.")  # fmt: skip
        prompt = {"type": "string", "description": f"the task for the {name} agent, self-contained"}
        parameters = {"type": "object", "properties": {"prompt": prompt}, "required": ["prompt"]}
        out.append({"type": "function", "function": {"name": tool_name(name), "description": description,
                                                      "parameters": parameters}})  # fmt: skip
    return out


def child_id(parent: str, key: str) -> str:
    """The id of the child run a call of ``parent`` starts (``key``: the call's
    ``<iteration>.<index>``): the same every time, and in the parent's shard. Readable
    (``<parent>-<iteration>-<index>-<n>``) while it fits 64 characters, else hashed."""
    stem = f"{parent}-{key.replace('.', '-')}"
    if len(stem) > 56:
        stem = "c" + hashlib.sha256(f"{parent}/{key}".encode()).hexdigest()[:40]
    want = shard_of(parent)
    for n in range(SHARDS * 64):  # each n lands in one of SHARDS shards: found within a few dozen
        candidate = f"{stem}-{n}"
        if zlib.crc32(candidate.encode()) % SHARDS == want:
            assert run_id_error(candidate) is None
            return candidate
    raise RuntimeError(f"no child id in shard {want} for {parent}/{key}")  # never: crc32 spreads evenly


# -- at submit: the tree, checked and stored inline --------------------------------------------
@dataclass(frozen=True)
class Lineage:
    """Where a spec sits in a tree of child runs, as validation walks down it."""

    roots: tuple[Path, ...]  # folders a child spec's file may lie in: the agents folder, the root spec's
    files: tuple[Path, ...] = ()  # the spec files from the root down to here: a cycle repeats one
    base: Path | None = None  # the folder a relative path is read from first (the naming file's)
    depth: int = 0  # the root run is at depth 0, its children at 1
    left: int = 3  # levels of children allowed below this spec

    @classmethod
    def root(cls, spec: RunSpec, agents_dir: str) -> Lineage:
        from orchestrator.agents import agents_root

        source = spec._source
        roots = (agents_root(agents_dir), *((source.parent,) if source else ()))
        return cls(roots, (source,) if source else (), source.parent if source else None, 0, spec.max_depth)


@dataclass
class Resolved:
    """One entry of a stored spec's ``agents``: the child's spec as checked and stored (its
    credentials sealed, its own agents resolved, no prompt) and the texts of its steering
    files and skills, read at submit."""

    spec: dict[str, Any]
    steering_docs: list[str] = field(default_factory=list)
    skill_docs: list[str] = field(default_factory=list)
    source: str = "inline"  # the file it was read from

    @classmethod
    def of(cls, entry: Any) -> Resolved | None:
        """A stored (resolved) entry; None for a path or an inline spec as a user writes it."""
        if isinstance(entry, dict) and isinstance(entry.get("spec"), dict) and "model" not in entry:
            steering, skills = entry.get("steering_docs") or [], entry.get("skill_docs") or []
            return cls(entry["spec"], list(steering), list(skills), str(entry.get("source") or "inline"))
        return None

    def dump(self) -> dict[str, Any]:
        return {"spec": self.spec, "steering_docs": self.steering_docs, "skill_docs": self.skill_docs,
                "source": self.source}  # fmt: skip


def check_agents(spec: RunSpec, store: RunStore | None, report: SpecReport, lineage: Lineage,
                 check_child: CheckChild) -> None:  # fmt: skip
    """Check every child spec as if submitted (``check_child``: their errors named
    ``agents.<name>.<field>``) and store the tree inline in ``report.stored_spec``."""
    if not spec.agents:
        return
    resolved: dict[str, Any] = {}
    for name, entry in spec.agents.items():
        where = f"agents.{name}"
        if lineage.left < 1:
            allowed = lineage.depth + lineage.left
            report.errors.append(f"{where}: a child run here would be at depth {lineage.depth + 1}; "
                                 f"max_depth allows {allowed}")  # fmt: skip
            continue
        found = _load(where, entry, lineage, report.errors)
        if found is None:
            continue
        data, docs, child_lineage = found
        child = _child_spec(where, name, data, spec, report.errors)
        if child is None:
            continue
        left = min(child.max_depth, lineage.left - 1)
        child = child.model_copy(update={"max_depth": left})
        sub = check_child(child, store, replace(child_lineage, depth=lineage.depth + 1, left=left))
        report.errors += [f"{where}.{e}" for e in sub.errors]
        report.warnings += [f"{where}.{w}" for w in sub.warnings]
        stored = sub.stored_spec.model_dump(mode="json", exclude={"prompt"})
        steering, skills = sub.steering_docs or docs.steering_docs, sub.skill_docs or docs.skill_docs
        resolved[name] = Resolved(stored, steering, skills, docs.source).dump()
    report.stored_spec = report.stored_spec.model_copy(update={"agents": resolved})


def _load(where: str, entry: Any, lineage: Lineage,
          errors: list[str]) -> tuple[dict[str, Any], Resolved, Lineage] | None:  # fmt: skip
    """The child's spec data, what a stored entry already carries, and the lineage below it."""
    if isinstance(entry, str):
        path = _locate(where, entry, lineage, errors)
        if path is None:
            return None
        data = _read(where, entry, path, errors)
        if data is None:
            return None
        below = Lineage(lineage.roots, (*lineage.files, path), path.parent, lineage.depth, lineage.left)
        return data, Resolved({}, source=str(path)), below
    if not isinstance(entry, dict):
        errors.append(f"{where}: a path to a spec file, or a spec")
        return None
    stored = Resolved.of(entry)
    if stored is not None:  # a stored spec submitted again (its files were read when it was first)
        return dict(stored.spec), stored, lineage
    return dict(entry), Resolved({}), lineage


def _locate(where: str, raw: str, lineage: Lineage, errors: list[str]) -> Path | None:
    """A child spec's file: relative to the folder of the spec naming it, else to the agents
    folder; it must lie in the agents folder or in the root spec's folder (checked before
    whether it exists: a spec sent to the API learns nothing of other files), and must not
    be one of the files above it (a cycle)."""
    typed = Path(raw).expanduser()
    bases = [] if typed.is_absolute() else [b for b in (lineage.base, *lineage.roots) if b is not None]
    candidates = [typed.resolve()] if typed.is_absolute() else [(b / typed).resolve() for b in bases]
    inside = [c for c in candidates if any(c.is_relative_to(root) for root in lineage.roots)]
    if not inside:
        roots = " or ".join(str(r) for r in lineage.roots)
        errors.append(f"{where}: {raw!r} resolves outside {roots}")
        return None
    path = next((c for c in inside if c.is_file()), None)
    if path is None:
        looked = ", ".join(str(b) for b in dict.fromkeys(bases)) or "/"
        errors.append(f"{where}: spec file {raw!r} not found (looked in {looked})")
        return None
    if path.suffix not in SPEC_SUFFIXES:
        errors.append(f"{where}: {raw!r} is not a spec file ({', '.join(SPEC_SUFFIXES)})")
        return None
    if path in lineage.files:
        chain = [*lineage.files[lineage.files.index(path) :], path]
        errors.append(f"{where}: cycle of spec files: {' -> '.join(p.name for p in chain)}")
        return None
    return path


def _read(where: str, raw: str, path: Path, errors: list[str]) -> dict[str, Any] | None:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        errors.append(f"{where}: {raw!r} cannot be read: {exc}")
        return None
    if not isinstance(data, dict):
        errors.append(f"{where}: {raw!r}: a spec is a mapping of fields")
        return None
    return data


def _child_spec(where: str, name: str, data: dict[str, Any], parent: RunSpec,
                errors: list[str]) -> RunSpec | None:  # fmt: skip
    """The child spec as a RunSpec: no prompt of its own, its parent's tenant."""
    from pydantic import ValidationError

    problems = []
    if "prompt" in data:
        problems.append(f"{where}.prompt: a child spec has no prompt: each call of {tool_name(name)} "
                        "gives it")  # fmt: skip
    if "tenant" in data and data["tenant"] != parent.tenant:
        problems.append(f"{where}.tenant: a child run runs for its parent's tenant ({parent.tenant!r})")
    if problems:
        errors += problems
        return None
    try:
        return RunSpec.model_validate({**data, "prompt": PROMPT_GIVEN, "tenant": parent.tenant})
    except ValidationError as exc:
        errors += [f"{where}.{m}" for m in validation_messages(exc)]
        return None


# -- at run time: the child's spec -------------------------------------------------------------
class ChildRefused(Exception):
    """A call of a child agent that starts no child: recorded failed, fed back to the model."""


def build_child(parent: RunSpec, agent: str, arguments: str, tokens_used: int,
                cost_usd: float) -> tuple[RunSpec, Resolved]:  # fmt: skip
    """The spec a call starts its child with: the stored child spec, the call's prompt, and
    budgets no larger than what is left of the parent's (``ChildRefused`` when nothing is,
    or the arguments are not a prompt)."""
    entry = Resolved.of(parent.agents.get(agent))
    if entry is None:
        raise ChildRefused(f"UnknownTool: no child agent named {agent!r}")
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ChildRefused(f"InvalidArguments: arguments are not valid JSON ({exc})") from exc
    prompt = args.get("prompt") if isinstance(args, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise ChildRefused("ValidationError: prompt: a non-empty string is required")
    if parent.max_depth < 1:
        raise ChildRefused(f"MaxDepth: this run may start no child runs (max_depth {parent.max_depth})")
    caps: dict[str, Any] = {"prompt": prompt, "tenant": parent.tenant}
    own = entry.spec.get("token_budget")
    if parent.token_budget is not None:
        left = parent.token_budget - tokens_used
        if left < 1:
            raise ChildRefused(f"BudgetExceeded: nothing is left of the token budget {parent.token_budget} "
                               f"({tokens_used} tokens used)")  # fmt: skip
        caps["token_budget"] = left if own is None else min(own, left)
    own_cost = entry.spec.get("cost_budget_usd")
    if parent.cost_budget_usd is not None:
        left_usd = parent.cost_budget_usd - cost_usd
        if left_usd <= 0:
            raise ChildRefused(f"CostBudgetExceeded: nothing is left of the cost budget "
                               f"${parent.cost_budget_usd:g} (${cost_usd:.6f} spent)")  # fmt: skip
        caps["cost_budget_usd"] = left_usd if own_cost is None else min(own_cost, left_usd)
    caps["max_depth"] = min(int(entry.spec.get("max_depth", 0)), parent.max_depth - 1)
    return RunSpec.model_validate({**entry.spec, **caps}), entry


# -- the step script (KEYS: the parent's, as every step script; ARGV after PRELUDE's) ----------
# Starts the child of one call and parks the call, or parks it again. KEYS: + the child's
# own keys (Keys.all_for_run), + its tenant index. ARGV: key, iteration, generation, child
# id, child spec, tenant, ancestors, parent JSON, agent, recheck ms, tree token budget,
# tree cost budget ('' none), call id, mode ('start', or 'park': only park it again), the
# child's messages...
# -> {'created'} (send its first turn) | {'waiting'} (it runs: parked again) | {'child_ended'}
#  (record the call now) | {'taken'} (that id is another run's) | {'missing'} (park: no child)
#  | {'ended'|'stale'|'done'|'paused'}
START_CHILD = """
local key, it, gen, child = arg(1), tonumber(arg(2)), tonumber(arg(3)), arg(4)
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase')
if not st[1] or ended(st[1]) then return {'ended'} end
if tonumber(st[2]) ~= it or st[3] ~= 'tools' then return {'stale'} end
local c = parse(redis.call('HGET', CSTATE, key))
if not c then return {'stale'} end
if c.kind == 'd' then return {'done'} end
if gen < c.gen then return {'stale'} end
if st[1] == 'paused' then return {'paused'} end
local CRUN, CMSGS, CEVENTS, CTENANT = KEYS[EXTRA], KEYS[EXTRA + 1], KEYS[EXTRA + 7], KEYS[EXTRA + NRUN]
local verdict = 'created'
local cst = redis.call('HMGET', CRUN, 'status', 'parent_key', 'ancestors')
if cst[1] then
  if cst[2] ~= key or string.match(cst[3] or '', '^(%S+)') ~= RUN_ID then return {'taken'} end
  if ended(cst[1]) then return {'child_ended'} end
  verdict = 'waiting'
elseif arg(14) ~= 'start' then
  return {'missing'}
else
  -- the child run, written as CREATE writes a run (scripts.py), with its lineage
  redis.call('HSET', CRUN, 'spec', arg(5), 'tenant', arg(6),
    'status', 'queued', 'phase', 'turn', 'iteration', 0, 'tokens_used', 0,
    'pending', 0, 'ncalls', 0, 'turn_claimed', 0, 'turn_gen', 1, 'turn_taken', 0,
    'turn_attempts', 0, 'turn_owner', '', 'turn_error', '', 'turn_deadline', NOW + LEASE,
    'created_at', NOW, 'updated_at', NOW,
    'parent', arg(8), 'parent_key', key, 'ancestors', arg(7), 'agent', arg(9))
  -- its tokens count into its tenant's share as its parent's do (orchestrator/fairshare.py)
  if redis.call('HGET', RUN, 'fair') then redis.call('HSET', CRUN, 'fair', 1) end
  for i = 15, #ARGV - 5 do redis.call('RPUSH', CMSGS, arg(i)) end
  redis.call('XADD', CEVENTS, 'MAXLEN', '~', MAXLEN, '*', 'type', 'queued', 'ts', NOW)
  redis.call('ZADD', RUNS, NOW, child)
  redis.call('ZADD', CTENANT, NOW, child)
  redis.call('ZADD', LEASES, NOW + LEASE, child)
  -- the parent: its children, how many it waits for, the budgets its children share
  local list = cjson.decode(redis.call('HGET', RUN, 'children') or '[]')
  list[#list + 1] = child
  redis.call('HSET', RUN, 'children', cjson.encode(list))
  redis.call('HINCRBY', RUN, 'children_waiting', 1)
  if arg(11) ~= '' then redis.call('HSET', RUN, 'tree_token_budget', arg(11)) end
  if arg(12) ~= '' then redis.call('HSET', RUN, 'tree_cost_budget', arg(12)) end
  event('child', 'iteration', it, 'call_id', arg(13), 'agent', arg(9), 'child', child)
end
c.kind, c.deadline, c.taken, c.owner = 'q', NOW + tonumber(arg(10)), gen, 'child'
put(key, c)
next_look()
return {verdict}
"""


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else "" if value is None else str(value)


CHILD_FIELDS = ("status", "exit", "content", "result", "error", "error_type", "parent_key", "ancestors",
                "created_at", "ended_at", "iteration", "tokens_used", "cost_usd")  # fmt: skip


@dataclass
class Look:
    """What a call of a child agent finds: its run's state, the stored call, the child's."""

    status: str  # the parent's
    iteration: int
    phase: str
    spec_json: str
    tokens_used: int
    cost_usd: float
    payload: dict[str, Any] | None  # the call as the turn stored it
    call_state: str  # the call's raw state ('' none)
    child: dict[str, str]  # the child's fields ({} : no such run)
    ancestors: list[str] = field(default_factory=list)  # the run's own (it may be a child)

    @property
    def call_gen(self) -> int:
        parts = self.call_state.split("|")
        return int(parts[3]) if len(parts) > 3 else 0

    @property
    def started(self) -> bool:
        """The call started a child before (parked for one)."""
        parts = self.call_state.split("|")
        return len(parts) > 5 and parts[5] == "child"


def look(store: RunStore, parent: str, key: str, child: str) -> Look:
    k = store.keys
    pipe = store.redis.pipeline(transaction=False)
    pipe.hmget(k.run(parent), "status", "iteration", "phase", "spec", "tokens_used", "cost_usd", "ancestors")
    pipe.hget(k.call_args(parent), key)
    pipe.hget(k.call_state(parent), key)
    pipe.hmget(k.run(child), CHILD_FIELDS)
    state, payload, call_state, child_state = pipe.execute()
    status, iteration, phase, spec_json, tokens, cost, ancestors = map(_s, state)
    try:
        stored = json.loads(payload) if payload else None
    except ValueError:
        stored = None
    fields = dict(zip(CHILD_FIELDS, map(_s, child_state), strict=True)) if child_state[0] else {}
    return Look(status, int(iteration or 0), phase, spec_json, int(tokens or 0), float(cost or 0),
                stored if isinstance(stored, dict) else None, _s(call_state), fields,
                ancestors.split())  # fmt: skip


def start(store: RunStore, parent: str, payload: dict[str, Any], gen: int, child: str, spec: RunSpec,
          messages: list[dict[str, Any]], ancestors: list[str], parent_spec: RunSpec) -> str:  # fmt: skip
    """START_CHILD (see the script): 'created', 'waiting', 'child_ended', 'taken', or why not."""
    k = store.keys
    ref = json.dumps({"run_id": parent, "call_id": payload["call_id"]})
    budget = "" if parent_spec.token_budget is None else str(parent_spec.token_budget)
    cost = "" if parent_spec.cost_budget_usd is None else repr(parent_spec.cost_budget_usd)
    out = store.run_script(
        "START_CHILD", START_CHILD, parent, payload["key"], payload["iteration"], gen, child,
        spec.model_dump_json(), spec.tenant, " ".join([parent, *ancestors]), ref, payload["agent"],
        RECHECK_S * 1000, budget, cost, payload["call_id"], "start", *(json.dumps(m) for m in messages),
        keys=(*k.all_for_run(child), k.tenant_runs(spec.tenant, shard_of(child))),
    )  # fmt: skip
    return _s(out[0])


def park(store: RunStore, parent: str, payload: dict[str, Any], gen: int, child: str,
         tenant: str) -> str:  # fmt: skip
    """Park the call again while its child runs (START_CHILD finds the child there)."""
    k = store.keys
    out = store.run_script(
        "START_CHILD", START_CHILD, parent, payload["key"], payload["iteration"], gen, child, "", tenant,
        "", "", payload.get("agent", ""), RECHECK_S * 1000, "", "", payload["call_id"], "park",
        keys=(*k.all_for_run(child), k.tenant_runs(tenant, shard_of(child))),
    )  # fmt: skip
    return _s(out[0])


def parent_call(store: RunStore, run_id: str) -> dict[str, str] | None:
    """The parent's call a run answers, if it is a child: {run_id, key, tool}; else None."""
    fields = store.redis.hmget(store.keys.run(run_id), "ancestors", "parent_key", "agent")
    ancestors, key, agent = map(_s, fields)
    if not ancestors:
        return None
    return {"run_id": ancestors.split(" ")[0], "key": key, "tool": tool_name(agent)}


# -- control and reading -------------------------------------------------------------------------
def children_of(store: RunStore, run_id: str) -> list[str]:
    raw = store.redis.hget(store.keys.run(run_id), "children")
    return [str(c) for c in json.loads(raw)] if raw else []


def paused_children(store: RunStore, run_id: str) -> list[str]:
    """The children of a run that are paused (resumed with it)."""
    statuses = {child: store.status(child) for child in children_of(store, run_id)}
    return [child for child, status in statuses.items() if status is not None and status.value == "paused"]


@dataclass
class Node:
    """One run of a tree, for ``tooloop status``."""

    run_id: str
    depth: int
    agent: str
    status: str
    exit: str
    tokens_used: int


def tree(store: RunStore, run_id: str, depth: int = 0, limit: int = 200) -> list[Node]:
    """The run's descendants, depth first (at most ``limit``)."""
    out: list[Node] = []
    for child in children_of(store, run_id):
        if len(out) >= limit:
            break
        fields = store.redis.hmget(store.keys.run(child), "agent", "status", "exit", "tokens_used")
        if fields[1] is None:
            continue  # expired
        agent, status, exit_, tokens = map(_s, fields)
        out.append(Node(child, depth + 1, agent, status, exit_, int(tokens or 0)))
        out += tree(store, child, depth + 1, limit - len(out))
    return out
