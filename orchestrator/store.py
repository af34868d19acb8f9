"""RunStore: all run state in Redis, each step one atomic round trip.

The worker's turn and tool tasks, the producer client, the CLI, the operator
API and the sweeper all go through this class; the key layout is in
``keys.py`` and the scripts in ``scripts.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import redis
from redis.cluster import RedisCluster

import orchestrator.scripts as scripts
from orchestrator.bounds import REASON_MAX_CHARS, STEER_MAX_CHARS, refuse_long
from orchestrator.connections import connect
from orchestrator.events import Event
from orchestrator.events import parse as parse_event
from orchestrator.keys import (
    SHARDS,
    STEER_MAX,
    WORKER_TTL_S,
    Keys,
    call_key,
    parse_call_key,
    run_id_error,
    shard_of,
)
from orchestrator.models import (
    LIMIT_EXITS,
    Exit,
    RunResult,
    RunSpec,
    Status,
    ToolCallRecord,
    status_for_exit,
)
from orchestrator.settings import Settings, get_settings

QUEUE_SCAN_SLICE = 1_000  # entries of a broker queue one script reads (~10 ms of Redis, loaded)
QUEUE_SCAN_MAX = 50_000  # entries one look into a queue reads at most
JUMP_SCAN = 200  # newest entries of a queue where a message just sent again is looked for


def now_ms() -> int:
    return int(time.time() * 1000)


def new_owner() -> str:
    """A claim's owner token: what fences a holder that was taken over."""
    return uuid.uuid4().hex[:16]


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


@lru_cache(maxsize=1024)
def parse_spec(spec_json: str) -> RunSpec:
    """Specs never change after submit: parse each one once per process."""
    return RunSpec.model_validate_json(spec_json)


@dataclass
class TurnClaim:
    spec: RunSpec
    tokens_used: int
    messages: list[dict[str, Any]]
    attempts: int = 1
    corrections: int = 0  # corrective messages sent so far (text tool calls that did not parse)
    cost_usd: float = 0.0


@dataclass(frozen=True)
class Held:
    """A step this process holds: heartbeated, handed back and recorded as its owner."""

    run_id: str
    kind: str  # "turn" | "call"
    key: str  # the call's key; "" for a turn
    owner: str
    iteration: int


@dataclass
class Finish:
    """The fields that end a run."""

    exit: str
    content: str = ""
    result: Any = None
    error: str = ""
    error_type: str = ""

    @property
    def status(self) -> Status:
        return status_for_exit(self.exit)

    @classmethod
    def unreadable(cls, exc: Exception) -> Finish:
        """A run whose stored spec no longer parses (code rolled back past a field): every
        step would fail the same way, so the step that finds it ends the run."""
        return cls(Exit.error, error=f"stored spec does not parse: {exc}", error_type="SpecUnreadable")


@dataclass
class Dispatch:
    """One message of a step: a turn (iteration) or a tool call (payload), at a generation."""

    run_id: str
    gen: int
    iteration: int = 0
    payload: dict[str, Any] | None = None

    @property
    def step(self) -> str:
        return "turn" if self.payload is None else self.payload["key"]


@dataclass
class CallStart:
    """START_CALL's answer: a verdict, and for 'ok', 'lost' and 'gate' the run's spec and
    the call as the turn stored it (what the tool task derives everything from)."""

    verdict: str
    spec: RunSpec | None = None
    call: dict[str, Any] | None = None


@dataclass
class Recovery:
    """The sweeper's look at one run: what to send again, what to look for in the queue."""

    run_id: str
    outcome: str = "steps"  # steps | gone | ended | pause_expired | gave_up | gated (fair share)
    sends: list[Dispatch] = field(default_factory=list)  # lost: send again now
    checks: list[Dispatch] = field(default_factory=list)  # never taken: late, or lost?


class RunStore:
    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.redis = client
        self.keys = Keys(self.settings.key_prefix)
        self._scripts = {
            name: client.register_script(scripts.PRELUDE + getattr(scripts, name))
            for name in scripts.RUN_SCRIPTS
        }
        self._due = client.register_script(scripts.DUE)
        self._queued = client.register_script(scripts.QUEUED)
        self._jump = client.register_script(scripts.JUMP)
        self._workers = client.register_script(scripts.WORKERS)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> RunStore:
        settings = settings or get_settings()
        # Blocking reads (XREAD BLOCK) wait up to 10 s: the socket must outlast them.
        client = connect(settings.redis_url, socket_timeout=30, health_check_interval=30)
        return cls(client, settings)

    # -- plumbing -----------------------------------------------------------
    def _run(self, script: str, run_id: str, *args: Any, pipe: Any = None, keys: tuple = ()) -> Any:
        s = self.settings
        argv = [run_id, int(s.lease_s * 1000), s.events_maxlen, s.retention_s, s.step_attempts, *args]
        return self._scripts[script](keys=self.keys.script_keys(run_id) + list(keys), args=argv,
                                     client=pipe or self.redis)  # fmt: skip

    def run_script(self, name: str, source: str, run_id: str, *args: Any, keys: tuple = ()) -> Any:
        """A step script of another module (``scripts.PRELUDE`` + ``source``, registered on first
        use): the same KEYS and leading ARGV as the store's own, ``keys`` after them."""
        if name not in self._scripts:
            self._scripts[name] = self.redis.register_script(scripts.PRELUDE + source)
        return self._run(name, run_id, *args, keys=keys)

    def time_ms(self) -> int:
        """Redis's clock: the one every lease is measured against."""
        seconds, micros = self.redis.time()
        return seconds * 1000 + micros // 1000

    # -- create -------------------------------------------------------------
    def create(self, run_id: str, spec: RunSpec, messages: list[dict[str, Any]], fair: str = "") -> int:
        """Write the run and its index entries in one script; its first turn's generation.
        ``fair`` (orchestrator/fairshare.py): 'track' counts its tokens into its tenant's;
        'gate' also holds its first turn until its tenant's queue admits it."""
        if bad := run_id_error(run_id):  # the producer checked; so does the store
            raise ValueError(bad)
        tenant_index = self.keys.tenant_runs(spec.tenant, shard_of(run_id))
        created = self._run("CREATE", run_id, spec.model_dump_json(), spec.tenant, fair,
                            *(json.dumps(m) for m in messages), keys=(tenant_index,))  # fmt: skip
        if not created:
            raise ValueError(f"run {run_id} already exists")
        return int(created)

    # -- turn ---------------------------------------------------------------
    def claim_turn(self, run_id: str, iteration: int, gen: int, owner: str) -> TurnClaim | str:
        """Claim turn ``iteration`` for ``owner``; a string says why not (ended, paused,
        stale, busy, gave_up: its attempts are spent and the run ended on error)."""
        out = self._run("CLAIM_TURN", run_id, iteration, gen, owner)
        if _s(out[0]) != "ok":
            return _s(out[0])
        messages = [json.loads(m) for m in out[6:]]
        return TurnClaim(parse_spec(_s(out[1])), int(out[2]), messages, int(out[3]), int(out[4]),
                         float(out[5]))  # fmt: skip

    def record_finish(self, run_id: str, iteration: int, owner: str, message: dict[str, Any],
                      tokens: int, end: Finish, cost_usd: float = 0.0) -> str:  # fmt: skip
        return _s(
            self._run(
                "RECORD_REPLY", run_id, iteration, owner, json.dumps(message), usage(tokens, cost_usd),
                "finish",
                end.status.value, end.exit, end.content, json.dumps(end.result), end.error,
                end.error_type,
            )
        )  # fmt: skip

    def record_tool_calls(self, run_id: str, iteration: int, owner: str, message: dict[str, Any],
                          tokens: int, payloads: list[dict[str, Any]],
                          cost_usd: float = 0.0) -> str:  # fmt: skip
        """Record a reply asking for tool calls; 'dispatch': send them. Each payload's
        ``call_id`` becomes the call's id in the run, unique (see RECORD_REPLY): a
        repeated one is rewritten, the model's kept as ``model_call_id``."""
        triples: list[str] = []
        for index, payload in enumerate(payloads):
            triples += [call_key(iteration, index), payload["call_id"], json.dumps(payload)]
        out = self._run("RECORD_REPLY", run_id, iteration, owner, json.dumps(message),
                        usage(tokens, cost_usd), "tools", *triples)  # fmt: skip
        if not isinstance(out, list):
            return _s(out)
        for payload, raw in zip(payloads, out[1:], strict=True):
            if (unique := _s(raw)) != payload["call_id"]:
                payload["model_call_id"], payload["call_id"] = payload["call_id"], unique
        return _s(out[0])

    def record_correction(self, run_id: str, iteration: int, owner: str, message: dict[str, Any],
                          tokens: int, correction: str,
                          cost_usd: float = 0.0) -> tuple[str, int]:  # fmt: skip
        """Record a reply with a corrective user message after it; ('continue', gen): send
        the next turn at that generation."""
        note = json.dumps({"role": "user", "content": correction})
        verdict = _s(self._run("RECORD_REPLY", run_id, iteration, owner, json.dumps(message),
                               usage(tokens, cost_usd), "continue", note))  # fmt: skip
        kind, _, gen = verdict.partition(":")
        return kind, int(gen or 0)

    def compact(
        self, run_id: str, iteration: int, expected: int, head: int, start: int, between: list[str],
        tokens: int, cost_usd: float, reason: str, fallback: bool, owner: str = "",
    ) -> str:  # fmt: skip
        """Replace messages[head:start] by ``between`` (JSON), if the history is still
        ``expected`` long and the turn still ``owner``'s; counts the summary's usage apart."""
        return _s(self._run(
            "COMPACT", run_id, iteration, owner, expected, head, start, usage(tokens, cost_usd), reason,
            int(fallback), *between,
        ))  # fmt: skip

    def fail_turn(self, run_id: str, iteration: int, owner: str, tokens: int, error: str,
                  cost_usd: float = 0.0) -> str:  # fmt: skip
        """A turn attempt raised: bill its reply (if any), then retry it or give up."""
        return _s(self._run("FAIL_TURN", run_id, iteration, owner, usage(tokens, cost_usd), error[:500]))

    def defer_turn(self, run_id: str, iteration: int, owner: str, wait_s: float) -> tuple[str, int]:
        """Hand a claimed turn back for ``wait_s`` (rate limits); ('ok', generation):
        re-enqueue it at that generation, with that countdown."""
        out = self._run("DEFER_TURN", run_id, iteration, owner, int(wait_s * 1000))
        return _s(out[0]), int(out[1]) if len(out) > 1 else 0

    def text_event(self, run_id: str, iteration: int, text: str) -> bool:
        """A piece of the model's streamed reply (scrubbed) for watchers, kept only in the
        capped event stream; False (not kept) once the run has ended."""
        return bool(self._run("TEXT", run_id, iteration, text))

    def text_events(self, pieces: list[tuple[str, int, str]]) -> list[bool | Exception]:
        """``text_event`` for each (run id, iteration, text), in one round trip (a failed
        one's error in its place)."""
        out = self._many("TEXT", [(run_id, (iteration, text)) for run_id, iteration, text in pieces])
        return [r if isinstance(r, Exception) else bool(r) for r in out]

    def add_usage(self, run_id: str, kind: str, tokens: int, cost_usd: float = 0.0) -> None:
        """Count a model call made for the run outside its turns' replies (the judge)."""
        self._run("ADD_USAGE", run_id, kind, usage(tokens, cost_usd))

    def finish(self, run_id: str, end: Finish, iterations: int | None = None,
               fence: tuple[int, str] | None = None) -> bool:  # fmt: skip
        """End a run that has not ended yet; False if it already had (or, with ``fence``
        = (iteration, owner), if that turn is no longer the run's current one)."""
        iteration, owner = fence or ("", "")
        done = self._run(
            "FINISH", run_id, end.status.value, end.exit, end.content, json.dumps(end.result),
            end.error, end.error_type, "" if iterations is None else iterations, iteration, owner,
        )  # fmt: skip
        return bool(done)

    # -- tool calls ---------------------------------------------------------
    def start_call(self, run_id: str, iteration: int, index: int, gen: int, owner: str, tool: str,
                   have: bool, gated: bool, idempotent: bool,
                   approved: bool = False) -> CallStart:  # fmt: skip
        """Claim a call for the message naming it (``tool``: the message's); with 'ok',
        'lost' and 'gate' come the run's spec and the call as the turn stored it."""
        out = self._run("START_CALL", run_id, call_key(iteration, index), iteration, gen, owner, tool,
                        int(have), int(gated), int(idempotent), int(approved))  # fmt: skip
        verdict = _s(out[0])
        if len(out) < 3:
            return CallStart(verdict)
        return CallStart(verdict, parse_spec(_s(out[1])), json.loads(out[2]))

    def record_call(self, run_id: str, iteration: int, index: int, owner: str, record: ToolCallRecord,
                    tool_message: str, gen: int = 0, worker: str = "") -> tuple[str, int]:  # fmt: skip
        """Record one call; ('next', generation) means the turn's barrier passed: send the
        next turn. ``owner`` '' records for nobody (the sweeper), if ``gen`` is still current.
        ``worker``: the Celery node that ran it, kept beside the record (the console shows
        it; ``RunResult`` does not carry it)."""
        stored = record.model_dump_json()
        if worker:
            stored = json.dumps({**json.loads(stored), "worker": worker})
        out = self._run(
            "RECORD_CALL", run_id, call_key(iteration, index), iteration, owner, gen,
            stored, tool_message, record.tool_name, int(record.success),
        )  # fmt: skip
        return _s(out[0]), int(out[1]) if len(out) > 1 else 0

    def fail_call(self, run_id: str, key: str, owner: str, error: str) -> str:
        """A call attempt raised in the worker's own code: retry it or give up."""
        return _s(self._run("FAIL_CALL", run_id, key, owner, error[:500]))

    def heartbeat(self, items: list[Held]) -> list[int]:
        """Extend the leases of held steps: 1 extended, 0 not ours any more, -1 run ended."""
        return self._each("BEAT", items)

    def hand_back(self, items: list[Held]) -> None:
        """Let the leases of steps this process will not finish lapse now (a worker
        shutting down): the next sweep, on any worker, sends them again."""
        self._each("HAND_BACK", items)

    def _each(self, script: str, items: list[Held]) -> list[int]:
        out = self._many(script, [(h.run_id, (h.kind, h.key, h.owner, h.iteration)) for h in items])
        for result in out:
            if isinstance(result, Exception):
                raise result
        return out

    def _many(self, script: str, calls: list[tuple[str, tuple]]) -> list[Any]:
        """``script`` once per (run_id, args), a failed call's error in its place: one
        pipeline on one Redis; on a Cluster one call each, since redis-py refuses EVALSHA
        in a cluster pipeline ("Calling pipelined function evalsha is blocked")."""
        if isinstance(self.redis, RedisCluster):
            out: list[Any] = []
            for run_id, args in calls:
                try:
                    out.append(self._run(script, run_id, *args))
                except redis.ResponseError as exc:  # as the pipeline would; a lost node raises
                    out.append(exc)
            return out
        pipe = self.redis.pipeline(transaction=False)
        for run_id, args in calls:
            self._run(script, run_id, *args, pipe=pipe)
        return pipe.execute(raise_on_error=False) if calls else []

    # -- fair share (orchestrator/fairshare.py) ------------------------------------
    def mark_waiting(self, run_id: str) -> str:
        """A gated run waits in its tenant's queue: 'ok', 'open' (admitted meanwhile), 'ended'."""
        return _s(self._run("MARK_WAITING", run_id))

    def open_gates(self, run_ids: list[str]) -> list[Dispatch | str | Exception]:
        """Admitted runs: each one's turn to send (once), or why none ('open': sent already,
        'paused': its resume sends it, 'ended', 'missing'); one pipeline."""
        out: list[Dispatch | str | Exception] = []
        for run_id, raw in zip(run_ids, self._many("OPEN_GATE", [(r, ()) for r in run_ids]), strict=True):
            if isinstance(raw, Exception) or _s(raw[0]) != "send":
                out.append(raw if isinstance(raw, Exception) else _s(raw[0]))
            else:
                out.append(Dispatch(run_id, int(raw[1]), iteration=int(raw[2])))
        return out

    # -- directives -----------------------------------------------------------
    def pause(self, run_id: str, by: str = "operator") -> str:
        """The PAUSE directive alone; with its child runs and fair share: ``orchestrator.control``."""
        raw = self.redis.hget(self.keys.run(run_id), "spec")
        if raw is None:
            return "missing"
        try:  # read without validating: a spec that no longer parses can still be paused
            pause_max_s = float(json.loads(raw).get("pause_max_s", 3600))
        except (ValueError, TypeError, AttributeError):
            pause_max_s = 3600.0
        return _s(self._run("PAUSE", run_id, int(pause_max_s * 1000), by))

    def resume(self, run_id: str, by: str = "operator") -> tuple[str, Recovery]:
        """('turn' | 'calls' | 'none' | a reason, the waiting steps): ``sends`` are to be
        sent now; ``checks`` may still be queued, so they are sent again (RESEND) only
        once found gone, as the sweeper does: one message per waiting step."""
        out = self._run("RESUME", run_id, by)
        kind = _s(out[0])
        return kind, _recovery(run_id, ["steps", *out[1:]])

    def steer(self, run_id: str, text: str, by: str = "operator", source: str = "operator") -> str:
        """'full' when STEER_MAX messages already wait for the next turn. ``source``:
        'operator' (a person: CLI, API, client), or 'supervisor' / 'judge' (see steer_entry)."""
        refuse_long("steer text", text, STEER_MAX_CHARS)
        message = steer_entry(text, source)
        return _s(self._run("STEER", run_id, json.dumps(message), by, STEER_MAX))

    def abort(self, run_id: str, by: str = "operator", reason: str = "abort requested") -> str:
        """The ABORT directive alone (with fair share: ``orchestrator.control``). ``TooLong``
        (nothing written) when ``reason`` is over REASON_MAX_CHARS."""
        refuse_long("reason", reason, REASON_MAX_CHARS)
        return _s(self._run("ABORT", run_id, by, reason))

    def mark_once(self, run_id: str, key: str, *event_fields: Any) -> bool:
        """Supervisor: True the first time ``key`` is marked for this run (emits an event)."""
        return bool(self._run("MARK_ONCE", run_id, key, now_ms(), *event_fields))

    # -- liveness -----------------------------------------------------------
    def due(self, shard: int, holder: str, batch: int = 1000) -> tuple[int, list[str], list[str]] | None:
        """Take the shard's sweep lock (None if another sweeper holds it) and read what is
        due: (Redis time, runs to look at, ended runs whose keys should have expired)."""
        lock_ms = max(100, int(self.settings.sweep_interval_s * 1000 * 0.8))
        keys = [self.keys.sweep_lock(shard), self.keys.leases(shard), self.keys.expiries(shard)]
        out = self._due(keys=keys, args=[lock_ms, holder, batch])
        if not out:
            return None
        return int(out[0]), [_s(r) for r in out[1]], [_s(m) for m in out[2]]

    def recover_many(self, run_ids: list[str]) -> list[Recovery | Exception]:
        """The sweeper's look at each run (one pipeline); a run that cannot be read gives
        its exception in its place, never failing the others."""
        results: list[Recovery | Exception] = []
        for run_id, out in zip(run_ids, self._many("RECOVER", [(r, ()) for r in run_ids]), strict=True):
            try:
                results.append(out if isinstance(out, Exception) else _recovery(run_id, out))
            except Exception as exc:  # e.g. a stored payload that is not JSON
                results.append(exc)
        return results

    def recover(self, run_id: str) -> Recovery:
        [out] = self.recover_many([run_id])
        if isinstance(out, Exception):
            raise out
        return out

    def resend(self, dispatch: Dispatch) -> Dispatch | None:
        """The message of a step was found gone: send the step again (None: it moved on)."""
        out = self._run("RESEND", dispatch.run_id, dispatch.step, dispatch.gen)
        kind = _s(out[0])
        if kind == "turn":
            return Dispatch(dispatch.run_id, int(out[2]), iteration=int(out[1]))
        if kind == "call":
            return Dispatch(dispatch.run_id, int(out[1]), payload=json.loads(out[2]))
        return None

    def queued(self, client: redis.Redis, queue_key: str, task_ids: list[str]) -> set[str]:
        """Which of ``task_ids`` wait in a kombu queue (a list on the broker's Redis).

        The list is read one slice of QUEUE_SCAN_SLICE entries per script, newest first: a
        message published meanwhile only pushes the others deeper, so none slips past the
        cursor, and Redis is never held for a pass over a long queue (one script over a
        100,000-message backlog held it for seconds). A look stops at QUEUE_SCAN_MAX
        entries: what it did not reach counts as waiting (its step is looked at again a
        lease later; in a backlog that deep it waits behind the others anyway)."""
        left, found, first = set(task_ids), set(), 0
        while left and first < QUEUE_SCAN_MAX:
            out = self._queued(keys=[queue_key], args=[first, QUEUE_SCAN_SLICE, *left], client=client)
            hits = {_s(i) for i in out[1:]}
            found, left = found | hits, left - hits
            if int(out[0]) < QUEUE_SCAN_SLICE:  # the end of the list
                return found
            first += QUEUE_SCAN_SLICE
        return found | left

    def jump(self, client: redis.Redis, queue_key: str, task_id: str) -> bool:
        """Move a message just published to a kombu queue (a list on the broker's Redis) to
        the end taken next (scripts.JUMP); False if it is not among the newest JUMP_SCAN."""
        return bool(self._jump(keys=[queue_key], args=[task_id, JUMP_SCAN], client=client))

    def drop_expired(self, shard: int, members: list[str], now: int) -> int:
        """Remove ended runs whose keys expired from the shard's run indexes (a run whose
        expiry was pushed back by a late write is looked at again later)."""
        if not members:
            return 0
        run_ids = [m.split("\t", 1)[0] for m in members]
        pipe = self.redis.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.pttl(self.keys.run(run_id))
        ttls = pipe.execute()
        expiries, dropped = self.keys.expiries(shard), 0
        for member, run_id, ttl in zip(members, run_ids, ttls, strict=True):
            if ttl != -2:  # still there: its expiry was pushed back (-1: none set, look later)
                pipe.zadd(expiries, {member: now + (ttl if ttl > 0 else self.settings.retention_s * 1000)})
                continue
            tenant = member.split("\t", 1)[1] if "\t" in member else "default"
            pipe.zrem(self.keys.runs(shard), run_id)
            pipe.zrem(self.keys.tenant_runs(tenant, shard), run_id)
            pipe.zrem(expiries, member)
            dropped += 1
        pipe.execute()
        return dropped

    def leases_due(self) -> int:
        """Runs past their next look, over all shards (`tooloop doctor`)."""
        now = self.time_ms()
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(SHARDS):
            pipe.zcount(self.keys.leases(shard), "-inf", now)
        return sum(pipe.execute())

    # -- reading ------------------------------------------------------------
    def state(self, run_id: str) -> dict[str, str]:
        return {_s(k): _s(v) for k, v in self.redis.hgetall(self.keys.run(run_id)).items()}

    def spec(self, run_id: str) -> RunSpec | None:
        raw = self.redis.hget(self.keys.run(run_id), "spec")
        return parse_spec(_s(raw)) if raw else None

    def status(self, run_id: str) -> Status | None:
        raw = self.redis.hget(self.keys.run(run_id), "status")
        return Status(_s(raw)) if raw else None

    def messages(self, run_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.redis.lrange(self.keys.messages(run_id), 0, -1)]

    def result(self, run_id: str) -> RunResult | None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.run(run_id))
        pipe.hgetall(self.keys.calls(run_id))
        raw_state, raw_calls = pipe.execute()
        if not raw_state:
            return None
        return build_result(run_id, {_s(k): _s(v) for k, v in raw_state.items()}, raw_calls)

    def list_runs(self, limit: int = 20, tenant: str | None = None) -> list[dict[str, str]]:
        """Newest runs first (of one tenant, if given), merged over the shards' indexes;
        expired runs are pruned from the index."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(SHARDS):
            index = self.keys.runs(shard) if tenant is None else self.keys.tenant_runs(tenant, shard)
            pipe.zrevrange(index, 0, limit - 1, withscores=True)
        newest = sorted(((score, _s(r)) for rows in pipe.execute() for r, score in rows), reverse=True)
        ids = [run_id for _, run_id in newest[:limit]]
        pipe = self.redis.pipeline(transaction=False)
        fields = ("status", "exit", "iteration", "tokens_used", "tenant", "created_at", "spec")
        for run_id in ids:
            pipe.hmget(self.keys.run(run_id), fields)
        rows, expired = [], []
        for run_id, values in zip(ids, pipe.execute(), strict=True):
            if values[0] is None:
                expired.append(run_id)
                continue
            row = dict(zip(fields, map(_s, values), strict=True))
            row["model"] = _model_of(row.pop("spec"))
            rows.append({"run_id": run_id, **row})
        for run_id in expired:
            shard = shard_of(run_id)
            index = self.keys.runs(shard) if tenant is None else self.keys.tenant_runs(tenant, shard)
            self.redis.zrem(index, run_id)
        return rows

    def run_ids_before(self, tenant: str, before: tuple[int, str] | None,
                       limit: int) -> list[tuple[int, str]]:  # fmt: skip
        """One page of a tenant's run index, newest first: ``(created_at ms, run_id)`` strictly
        older than ``before`` in (created_at, run_id) order. A merge over the shards that
        reads a few entries of each per round trip (about twice the page in all) and
        never the whole index: a tenant with 100,000 runs pages as fast as one with 10."""
        per = max(4, -(-2 * limit // SHARDS))  # entries read per shard and round
        cursors: dict[int, tuple[int, str] | None] = dict.fromkeys(range(SHARDS), before)
        found: list[tuple[int, str]] = []  # read, not yet known to be the next newest
        out: list[tuple[int, str]] = []
        while cursors and len(out) < limit:
            fetched = self._older(tenant, cursors, per)
            for shard, rows in fetched.items():
                found += rows
                if len(rows) < per:
                    del cursors[shard]  # this shard has nothing older
                else:
                    cursors[shard] = rows[-1]
            # safe to emit: newer than the oldest read of every shard that may hold more
            frontier = max((c for c in cursors.values() if c is not None), default=None)
            found.sort(reverse=True)
            cut = len(found) if frontier is None else sum(1 for row in found if row > frontier)
            out += found[:cut]
            found = found[cut:]
        return out[:limit]

    def _older(self, tenant: str, cursors: dict[int, tuple[int, str] | None],
               per: int) -> dict[int, list[tuple[int, str]]]:  # fmt: skip
        """Up to ``per`` entries of each shard older than its cursor, newest first (one round
        trip; the cursor's own millisecond is read whole and cut by id: ties are few)."""
        pipe = self.redis.pipeline(transaction=False)
        for shard, cursor in cursors.items():
            index = self.keys.tenant_runs(tenant, shard)
            if cursor is None:
                pipe.zrevrangebyscore(index, "+inf", "-inf", start=0, num=per, withscores=True)
            else:
                pipe.zrevrangebyscore(index, cursor[0], cursor[0], withscores=True)
                pipe.zrevrangebyscore(index, f"({cursor[0]}", "-inf", start=0, num=per, withscores=True)
        replies = iter(pipe.execute())
        out: dict[int, list[tuple[int, str]]] = {}
        for shard, cursor in cursors.items():
            rows = [(int(score), _s(m)) for m, score in next(replies)]
            if cursor is not None:
                rows = [r for r in rows if r < cursor] + [(int(sc), _s(m)) for m, sc in next(replies)]
            out[shard] = rows[:per]
        return out

    def read_events(
        self, run_id: str, after: str = "0", block_ms: int | None = None, count: int = 100
    ) -> list[Event]:
        """The run's events after stream id ``after``, typed (``orchestrator.events``)."""
        resp = self.redis.xread({self.keys.events(run_id): after}, count=count, block=block_ms)
        if not resp:
            return []
        _, entries = resp[0]
        return [parse_event(_s(i), {_s(k): _s(v) for k, v in fields.items()}) for i, fields in entries]

    def follow_events(self, run_id: str, timeout: float | None = None) -> Iterator[Event]:
        """Yield the run's events from the start, live, until its outcome (or timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        after = "0"
        while True:
            remaining = 10.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            block = int(min(remaining, 10.0) * 1000) or 1
            for event in self.read_events(run_id, after, block_ms=block):
                after = event.id
                yield event
                if event.type == "outcome":
                    return
            if after == "0" and self.redis.exists(self.keys.run(run_id)) == 0:
                return

    # -- worker registry / tool catalog -----------------------------------------
    def publish_worker(self, name: str, info: dict[str, Any]) -> None:
        info = {**info, "seen": self.time_ms() / 1000}  # Redis's clock: hosts may disagree
        self.redis.hset(self.keys.workers(), name, json.dumps(info))

    def remove_worker(self, name: str) -> None:
        self.redis.hdel(self.keys.workers(), name)

    def live_workers(self) -> dict[str, dict[str, Any]]:
        """Workers seen within WORKER_TTL_S; entries of long-dead ones are dropped. One round
        trip: the registry and Redis's clock (every submit asks)."""
        seconds, micros, *flat = self._workers(keys=[self.keys.workers()])
        now = int(seconds) + int(micros) / 1e6
        workers, dead = {}, []
        for name, raw in zip(flat[::2], flat[1::2], strict=True):
            info = json.loads(raw)
            seen = info.get("seen", 0)
            if seen >= now - WORKER_TTL_S:
                workers[_s(name)] = info
            elif seen < now - 100 * WORKER_TTL_S:
                dead.append(name)
        if dead:
            self.redis.hdel(self.keys.workers(), *dead)
        return workers

    def tools_last_seen(self) -> dict[str, float]:
        """Tool name -> when a worker publishing it was last seen (Redis time, seconds),
        over every registry entry, dead workers' included (kept 100 x WORKER_TTL_S)."""
        seen: dict[str, float] = {}
        for raw in self.redis.hvals(self.keys.workers()):
            info = json.loads(raw)
            for tool in info.get("tools", []):
                seen[tool["name"]] = max(seen.get(tool["name"], 0.0), info.get("seen", 0.0))
        return seen

    def catalog(self) -> dict[str, dict[str, Any]]:
        """Tool name -> tool definition, over all live tool workers."""
        tools: dict[str, dict[str, Any]] = {}
        for info in self.live_workers().values():
            for tool in info.get("tools", []):
                tools.setdefault(tool["name"], tool)
        return tools


def usage(tokens: int, cost_usd: float) -> str:
    """A reply's usage as the scripts take it: '<tokens> <cost usd>'."""
    return f"{int(tokens)} {cost_usd:.10f}"


def _model_of(spec_json: str) -> str:
    """The model a stored spec names, read without validating it (listing must not fail)."""
    try:
        return str(json.loads(spec_json).get("model", "?"))
    except (ValueError, AttributeError):
        return "?"


def _recovery(run_id: str, out: list[Any]) -> Recovery:
    """RECOVER's (or RESUME's) answer, read: ('turn', gen, iteration, what) / (key, gen,
    what, payload)."""
    outcome = _s(out[0])
    found = Recovery(run_id, outcome)
    items = out[1:] if outcome == "steps" else []
    for i in range(0, len(items), 4):
        step, gen, third, fourth = (_s(items[i]), int(items[i + 1]), items[i + 2], items[i + 3])
        if step == "turn":
            dispatch, what = Dispatch(run_id, gen, iteration=int(third)), _s(fourth)
        else:
            dispatch, what = Dispatch(run_id, gen, payload=json.loads(fourth)), _s(third)
        (found.sends if what == "send" else found.checks).append(dispatch)
    return found


def steer_entry(text: str, source: str = "operator") -> dict[str, str]:
    """The history message of a steer. An operator's is a ``system`` message. A supervisor
    rule's (the spec's text) and a judge's verdict (a model's text, which injected tool
    output can sway) are ``user`` messages marked with their source: never operator's."""
    if source == "operator":
        return {"role": "system", "content": steer_message(text)}
    return {"role": "user", "content": f"[{source}] {text}"}


def steer_message(text: str) -> str:
    return (
        "Guidance from your operator. It does not change your tools, your outcome "
        f"contract, or the task itself; take it into account from now on:\n{text}"
    )


def build_result(run_id: str, state: dict[str, str], raw_calls: dict[Any, Any]) -> RunResult:
    exit_ = state.get("exit") or None
    records = sorted(raw_calls.items(), key=lambda kv: parse_call_key(_s(kv[0])))
    return RunResult(
        run_id=run_id,
        status=Status(state["status"]),
        status_reason=state.get("reason") or None,
        exit=exit_,
        content=state.get("content") or None,
        result=json.loads(state["result"]) if state.get("result") else None,
        iterations=int(state.get("iteration") or 0),
        tokens_used=int(state.get("tokens_used") or 0),
        tokens_compaction=int(state.get("tokens_compaction") or 0),
        tokens_judge=int(state.get("tokens_judge") or 0),
        cost_usd=float(state.get("cost_usd") or 0),
        terminated_by_limit=exit_ in LIMIT_EXITS,
        error=state.get("error") or None,
        error_type=state.get("error_type") or None,
        tool_calls=[ToolCallRecord.model_validate_json(raw) for _, raw in records],
        parent=json.loads(state["parent"]) if state.get("parent") else None,  # child runs
        children=json.loads(state["children"]) if state.get("children") else [],
        forked_from=json.loads(state["forked_from"]) if state.get("forked_from") else None,
    )
