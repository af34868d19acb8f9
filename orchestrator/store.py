"""RunStore: all run state in Redis, each step one atomic round trip.

The worker's turn and tool tasks, the producer client, the CLI, the operator
API and the sweeper all go through this class; the key layout is in
``keys.py`` and the scripts in ``scripts.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import redis

from orchestrator import scripts
from orchestrator.keys import WORKER_TTL_S, Keys, call_key, parse_call_key
from orchestrator.models import (
    LIMIT_EXITS,
    RunResult,
    RunSpec,
    Status,
    ToolCallRecord,
    status_for_exit,
)
from orchestrator.settings import Settings, get_settings


def now_ms() -> int:
    return int(time.time() * 1000)


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


@dataclass
class Recovery:
    """What the sweeper must re-enqueue for one run."""

    run_id: str
    turn: int | None = None  # re-enqueue this turn
    calls: list[dict[str, Any]] | None = None  # re-enqueue these tool payloads
    pause_expired: bool = False


class RunStore:
    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.redis = client
        self.keys = Keys(self.settings.key_prefix)
        self._scripts = {
            name: client.register_script(scripts.PRELUDE + getattr(scripts, name))
            for name in (
                "CREATE", "CLAIM_TURN", "RECORD_REPLY", "FINISH", "START_CALL",
                "RECORD_CALL", "BEAT", "PAUSE", "RESUME", "ABORT", "STEER",
                "RECOVER", "MARK_ONCE",
            )
        }  # fmt: skip

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> RunStore:
        settings = settings or get_settings()
        # Blocking reads (XREAD BLOCK) wait up to 10 s: the socket must outlast them.
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=30, health_check_interval=30)
        return cls(client, settings)

    # -- plumbing -----------------------------------------------------------
    def _run(self, script: str, run_id: str, *args: Any, pipe: Any = None) -> Any:
        keys = self.keys.all_for_run(run_id)
        return self._scripts[script](keys=keys, args=list(args), client=pipe or self.redis)

    @property
    def _maxlen(self) -> int:
        return self.settings.events_maxlen

    def _deadline(self, now: int) -> int:
        return now + int(self.settings.lease_s * 1000)

    # -- create -------------------------------------------------------------
    def create(self, run_id: str, spec: RunSpec, messages: list[dict[str, Any]]) -> None:
        now = now_ms()
        pipe = self.redis.pipeline(transaction=False)
        self._run(
            "CREATE", run_id, now, self._maxlen, spec.model_dump_json(), spec.tenant,
            self._deadline(now), *(json.dumps(m) for m in messages), pipe=pipe,
        )  # fmt: skip
        pipe.zadd(self.keys.runs(), {run_id: now})
        pipe.zadd(self.keys.tenant_runs(spec.tenant), {run_id: now})
        pipe.zadd(self.keys.leases(), {run_id: self._deadline(now)})
        created, *_ = pipe.execute()
        if not created:
            raise ValueError(f"run {run_id} already exists")

    # -- turn ---------------------------------------------------------------
    def claim_turn(self, run_id: str, iteration: int) -> TurnClaim | str:
        """Claim turn ``iteration``; a string says why not (ended, paused, stale, busy)."""
        now = now_ms()
        out = self._run("CLAIM_TURN", run_id, iteration, now, self._deadline(now), self._maxlen)
        if _s(out[0]) != "ok":
            return _s(out[0])
        messages = [json.loads(m) for m in out[3:]]
        return TurnClaim(parse_spec(_s(out[1])), int(out[2]), messages)

    def record_finish(
        self, run_id: str, iteration: int, message: dict[str, Any], tokens: int, end: Finish
    ) -> str:
        now = now_ms()
        return _s(
            self._run(
                "RECORD_REPLY", run_id, iteration, now, self._maxlen, self.settings.retention_s,
                json.dumps(message), tokens, "finish", end.status.value, end.exit, end.content,
                json.dumps(end.result), end.error, end.error_type,
            )
        )  # fmt: skip

    def record_tool_calls(
        self,
        run_id: str,
        iteration: int,
        message: dict[str, Any],
        tokens: int,
        payloads: list[dict[str, Any]],
    ) -> str:
        now = now_ms()
        pairs: list[str] = []
        for index, payload in enumerate(payloads):
            pairs += [call_key(iteration, index), json.dumps(payload)]
        return _s(
            self._run(
                "RECORD_REPLY", run_id, iteration, now, self._maxlen, self.settings.retention_s,
                json.dumps(message), tokens, "tools", self._deadline(now), *pairs,
            )
        )  # fmt: skip

    def finish(self, run_id: str, end: Finish, iterations: int | None = None) -> bool:
        """End a run that has not ended yet; False if it already had."""
        done = self._run(
            "FINISH", run_id, now_ms(), self._maxlen, self.settings.retention_s,
            end.status.value, end.exit, end.content, json.dumps(end.result), end.error,
            end.error_type, "" if iterations is None else iterations,
        )  # fmt: skip
        return bool(done)

    # -- tool calls ---------------------------------------------------------
    def start_call(self, run_id: str, iteration: int, index: int, idempotent: bool) -> str:
        now = now_ms()
        key = call_key(iteration, index)
        return _s(
            self._run("START_CALL", run_id, key, iteration, now, self._deadline(now), int(idempotent))
        )

    def record_call(
        self, run_id: str, iteration: int, index: int, record: ToolCallRecord, tool_message: str
    ) -> str:
        """Record one call; 'next' means the turn's barrier passed: enqueue the next turn."""
        now = now_ms()
        return _s(
            self._run(
                "RECORD_CALL", run_id, call_key(iteration, index), iteration, now, self._maxlen,
                self.settings.retention_s, record.model_dump_json(), tool_message,
                record.tool_name, int(record.success), self._deadline(now),
            )
        )  # fmt: skip

    def heartbeat(self, items: list[tuple[str, str, str]]) -> list[int]:
        """Extend leases of in-flight steps: (run_id, 'turn'|'call', call key)."""
        return self._beat(items, self._deadline(now_ms()))

    def hand_back(self, items: list[tuple[str, str, str]]) -> None:
        """Expire the leases of steps this process will not finish (a worker shutting
        down): the next sweep, on any worker, re-dispatches them."""
        now = now_ms()
        self._beat(items, now)
        if items:
            self.redis.zadd(self.keys.leases(), {run_id: now for run_id, _, _ in items})

    def _beat(self, items: list[tuple[str, str, str]], deadline: int) -> list[int]:
        if not items:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for run_id, kind, key in items:
            self._run("BEAT", run_id, kind, key, deadline, pipe=pipe)
        return pipe.execute()

    # -- directives -----------------------------------------------------------
    def pause(self, run_id: str, by: str = "operator") -> str:
        spec = self.spec(run_id)
        if spec is None:
            return "missing"
        now = now_ms()
        deadline = now + int(spec.pause_max_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        self._run("PAUSE", run_id, now, self._maxlen, deadline, by, pipe=pipe)
        pipe.zadd(self.keys.leases(), {run_id: deadline}, lt=True)
        return _s(pipe.execute()[0])

    def resume(self, run_id: str, by: str = "operator") -> tuple[str, list[Any]]:
        """Returns ('turn', [iteration]) / ('calls', [payload...]) to enqueue, or a reason."""
        now = now_ms()
        out = self._run("RESUME", run_id, now, self._maxlen, self._deadline(now), by)
        kind = _s(out[0])
        if kind == "turn":
            return kind, [int(out[1])]
        if kind == "calls":
            return kind, [json.loads(p) for p in out[1:]]
        return kind, []

    def steer(self, run_id: str, text: str, by: str = "operator") -> str:
        message = {"role": "system", "content": steer_message(text)}
        return _s(self._run("STEER", run_id, now_ms(), self._maxlen, json.dumps(message), by))

    def abort(self, run_id: str, by: str = "operator", reason: str = "abort requested") -> str:
        out = self._run(
            "ABORT", run_id, now_ms(), self._maxlen, self.settings.retention_s, by, reason
        )
        return _s(out)

    def mark_once(self, run_id: str, key: str, *event_fields: Any) -> bool:
        """Supervisor: True the first time ``key`` is marked for this run (emits an event)."""
        now = now_ms()
        return bool(self._run("MARK_ONCE", run_id, key, now, now, self._maxlen, *event_fields))

    # -- liveness -----------------------------------------------------------
    def recover(self, run_id: str) -> Recovery | None:
        """Look at one run due in the lease index; return what must be re-enqueued."""
        now = now_ms()
        out = self._run("RECOVER", run_id, now, self._deadline(now), self._maxlen)
        kind = _s(out[0])
        if kind in ("ended", "gone"):
            self.redis.zrem(self.keys.leases(), run_id)
            return None
        if kind == "pause_expired":
            return Recovery(run_id, pause_expired=True)
        self.redis.zadd(self.keys.leases(), {run_id: int(out[1])})
        if kind == "turn":
            return Recovery(run_id, turn=int(out[2]))
        if kind == "calls":
            return Recovery(run_id, calls=[json.loads(p) for p in out[2:]])
        return None

    def due_runs(self, limit: int = 500) -> list[str]:
        """Runs whose next look is due; one sweeper per interval across all workers."""
        lock_ms = int(self.settings.sweep_interval_s * 1000 * 0.8)
        if not self.redis.set(self.keys.sweep_lock(), "1", nx=True, px=max(lock_ms, 100)):
            return []
        due = self.redis.zrangebyscore(self.keys.leases(), "-inf", now_ms(), start=0, num=limit)
        return [_s(r) for r in due]

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
        """Newest runs first (of one tenant, if given); expired runs are pruned from the index."""
        index = self.keys.runs() if tenant is None else self.keys.tenant_runs(tenant)
        ids = [_s(r) for r in self.redis.zrevrange(index, 0, limit - 1)]
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
            row["model"] = parse_spec(row.pop("spec")).model
            rows.append({"run_id": run_id, **row})
        if expired:
            self.redis.zrem(index, *expired)
        return rows

    def read_events(
        self, run_id: str, after: str = "0", block_ms: int | None = None, count: int = 100
    ) -> list[tuple[str, dict[str, str]]]:
        resp = self.redis.xread({self.keys.events(run_id): after}, count=count, block=block_ms)
        if not resp:
            return []
        _, entries = resp[0]
        return [(_s(i), {_s(k): _s(v) for k, v in fields.items()}) for i, fields in entries]

    def follow_events(
        self, run_id: str, timeout: float | None = None
    ) -> Iterator[tuple[str, dict[str, str]]]:
        """Yield the run's events from the start, live, until its outcome (or timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        after = "0"
        while True:
            remaining = 10.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            block = int(min(remaining, 10.0) * 1000) or 1
            for event_id, event in self.read_events(run_id, after, block_ms=block):
                after = event_id
                yield event_id, event
                if event.get("type") == "outcome":
                    return
            if after == "0" and self.redis.exists(self.keys.run(run_id)) == 0:
                return

    # -- worker registry / tool catalog -----------------------------------------
    def publish_worker(self, name: str, info: dict[str, Any]) -> None:
        info = {**info, "seen": time.time()}
        self.redis.hset(self.keys.workers(), name, json.dumps(info))

    def remove_worker(self, name: str) -> None:
        self.redis.hdel(self.keys.workers(), name)

    def live_workers(self) -> dict[str, dict[str, Any]]:
        """Workers seen within WORKER_TTL_S; entries of long-dead ones are dropped."""
        now = time.time()
        workers, dead = {}, []
        for name, raw in self.redis.hgetall(self.keys.workers()).items():
            info = json.loads(raw)
            seen = info.get("seen", 0)
            if seen >= now - WORKER_TTL_S:
                workers[_s(name)] = info
            elif seen < now - 100 * WORKER_TTL_S:
                dead.append(name)
        if dead:
            self.redis.hdel(self.keys.workers(), *dead)
        return workers

    def catalog(self) -> dict[str, dict[str, Any]]:
        """Tool name -> tool definition, over all live tool workers."""
        tools: dict[str, dict[str, Any]] = {}
        for info in self.live_workers().values():
            for tool in info.get("tools", []):
                tools.setdefault(tool["name"], tool)
        return tools


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
        exit=exit_,
        content=state.get("content") or None,
        result=json.loads(state["result"]) if state.get("result") else None,
        iterations=int(state.get("iteration") or 0),
        tokens_used=int(state.get("tokens_used") or 0),
        terminated_by_limit=exit_ in LIMIT_EXITS,
        error=state.get("error") or None,
        error_type=state.get("error_type") or None,
        tool_calls=[ToolCallRecord.model_validate_json(raw) for _, raw in records],
    )
