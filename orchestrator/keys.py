"""Every Redis key, queue name and TTL tooloop uses, in one place.

Runs are spread over ``SHARDS`` shards by a hash of their id. A run's keys and its
shard's indexes (leases, runs, per-tenant runs, expiries) share the shard's hash tag
``{s<n>}``: on Redis Cluster a shard is one slot, so the Lua scripts that update a run
and its shard's indexes together stay atomic, and no script ever spans two shards.
Each shard is swept on its own, under its own lock. Global keys (the worker
registry) are only ever touched on their own.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

EVENTS_MAXLEN = 1000  # default progress events kept per run (approximate trim)
WORKER_TTL_S = 30  # a worker not seen for this long is not live
CATALOG_REFRESH_S = 10  # workers re-publish their catalog this often
SHARDS = 32  # fixed for a deployment: a run's keys are named after its shard
STEER_MAX = 100  # steer messages waiting for the next turn, per run


RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a run id names keys and a folder: a plain name only


def run_id_error(run_id: object) -> str | None:
    """Why ``run_id`` is refused, or None (``../x``, ``/etc``, ``a}b`` would reach past the
    run's folder or its keys' hash tag)."""
    if isinstance(run_id, str) and RUN_ID.fullmatch(run_id):
        return None
    return f"run_id: {run_id!r} must match [A-Za-z0-9_-]{{1,64}}"


def shard_of(run_id: str) -> int:
    """Stable across processes and hosts (unlike ``hash()``)."""
    return zlib.crc32(run_id.encode()) % SHARDS


@dataclass(frozen=True)
class Keys:
    prefix: str

    # -- one run ------------------------------------------------------------
    def _tag(self, shard: int) -> str:
        return f"{self.prefix}:{{s{shard}}}"

    def _run(self, run_id: str, part: str) -> str:
        # A child run lives in its parent's shard (orchestrator/children.py), and a script on
        # one run reaches its parent's or children's keys by putting their id in place of its
        # own (``key_of`` in scripts.PRELUDE): the id stays the only variable part of the name.
        return f"{self._tag(shard_of(run_id))}:run:{run_id}:{part}"

    def run(self, run_id: str) -> str:
        """Hash: status, iteration, tokens_used, exit, spec, timestamps, ..."""
        return self._run(run_id, "state")

    def messages(self, run_id: str) -> str:
        """List of JSON chat messages, in conversation order."""
        return self._run(run_id, "messages")

    def calls(self, run_id: str) -> str:
        """Hash ``<iteration>.<index>`` -> final ToolCallRecord JSON."""
        return self._run(run_id, "calls")

    def call_state(self, run_id: str) -> str:
        """Hash ``<iteration>.<index>`` -> the call's state (see scripts.py), current turn only."""
        return self._run(run_id, "callstate")

    def call_args(self, run_id: str) -> str:
        """Hash ``<iteration>.<index>`` -> tool task payload (for re-dispatch), current turn only."""
        return self._run(run_id, "callargs")

    def tool_messages(self, run_id: str) -> str:
        """Hash ``<iteration>.<index>`` -> tool message, until the turn's barrier."""
        return self._run(run_id, "toolmsgs")

    def steer(self, run_id: str) -> str:
        """List of pending steer texts, drained at the next turn boundary."""
        return self._run(run_id, "steer")

    def events(self, run_id: str) -> str:
        """Stream of progress events (metadata only)."""
        return self._run(run_id, "events")

    def supervisor(self, run_id: str) -> str:
        """Hash: supervisor rules fired, judge in flight, detector state."""
        return self._run(run_id, "supervisor")

    def claims(self, run_id: str) -> str:
        """Hash owner token -> iteration: turn claims whose reply is not billed yet."""
        return self._run(run_id, "claims")

    def approvals(self, run_id: str) -> str:
        """Hash ``<iteration>.<index>`` -> approval record JSON (orchestrator/approvals.py)."""
        return self._run(run_id, "approvals")

    def call_ids(self, run_id: str) -> str:
        """Hash call id -> ``<iteration>.<index>``: every call id of the run, each unique (made
        so when the reply is recorded: see RECORD_REPLY); approvals are addressed by it."""
        return self._run(run_id, "callids")

    def journal(self, run_id: str) -> str:
        """Hash: per turn, what replay and fork need and the history does not keep (the
        request's digest, the reply as received, the tokens before the turn) and what
        compaction took out of the history (orchestrator/journal.py)."""
        return self._run(run_id, "journal")

    def all_for_run(self, run_id: str) -> list[str]:
        """The run's own keys, in the order scripts.PRELUDE names them."""
        return [
            self.run(run_id),
            self.messages(run_id),
            self.calls(run_id),
            self.call_state(run_id),
            self.call_args(run_id),
            self.tool_messages(run_id),
            self.steer(run_id),
            self.events(run_id),
            self.supervisor(run_id),
            self.claims(run_id),
            self.approvals(run_id),  # expires with the run (orchestrator/approvals.py)
            self.call_ids(run_id),
            self.journal(run_id),  # orchestrator/journal.py
        ]

    def script_keys(self, run_id: str) -> list[str]:
        """KEYS of every run script: the run's keys, then its shard's indexes."""
        return self.all_for_run(run_id) + self.shard_keys(shard_of(run_id))

    # -- one shard ------------------------------------------------------------
    def runs(self, shard: int) -> str:
        """Sorted set run_id -> created_at (ms): `tooloop list` merges the shards."""
        return f"{self._tag(shard)}:runs"

    def tenant_runs(self, tenant: str, shard: int) -> str:
        """Sorted set run_id -> created_at (ms), one per tenant and shard: the API's list."""
        return f"{self._tag(shard)}:tenant:{tenant}:runs"

    def leases(self, shard: int) -> str:
        """Sorted set run_id -> when the sweeper must look at the run next (ms)."""
        return f"{self._tag(shard)}:leases"

    def expiries(self, shard: int) -> str:
        """Sorted set ``run_id<TAB>tenant`` -> when the ended run's keys expire (ms)."""
        return f"{self._tag(shard)}:expiries"

    def sweep_lock(self, shard: int) -> str:
        return f"{self._tag(shard)}:sweeper"

    def tenant_tokens(self, shard: int) -> str:
        """Hash ``<tenant>|<10 s bucket>`` -> model tokens its runs in this shard recorded then,
        and ``<tenant>|total`` -> all of them: written where usage is billed, only for runs
        under fair share (orchestrator/fairshare.py sums the shards)."""
        return f"{self._tag(shard)}:tenant_tokens"

    def shard_keys(self, shard: int) -> list[str]:
        return [self.leases(shard), self.runs(shard), self.expiries(shard), self.tenant_tokens(shard)]

    # -- global -------------------------------------------------------------
    def workers(self) -> str:
        """Hash worker name -> JSON {seen, queues, tools: [ToolDef...]}."""
        return f"{self.prefix}:workers"

    def rate_bucket(self, scope: str) -> str:
        """Hash {level, ts}: one token bucket of the shared rate limits, e.g.
        ``model:openai/gpt-4o:rpm``. One hash tag for all, so one script takes from several."""
        return f"{self.prefix}:{{ratelimit}}:{scope}"

    # -- tenant fair share (orchestrator/fairshare.py): one hash tag, one slot -----------
    def _fair(self, part: str) -> str:
        return f"{self.prefix}:{{fair}}:{part}"

    def fair_runs(self) -> str:
        """Hash run_id -> ``<state>|<tenant>``: a run under fair share that is waiting (``w``),
        holding a slot (``a``) or parked with its slot given up (``p``)."""
        return self._fair("runs")

    def fair_active(self) -> str:
        """Hash tenant -> runs holding a slot."""
        return self._fair("active")

    def fair_tenants(self) -> str:
        """Set of the tenants with runs waiting."""
        return self._fair("tenants")

    def fair_waiting(self, tenant: str) -> str:
        """Sorted set run_id -> submit sequence: the tenant's runs waiting, in order."""
        return self._fair(f"waiting:{tenant}")

    def fair_seq(self) -> str:
        """Counter: the submit sequence of waiting runs."""
        return self._fair("seq")

    def fair_lock(self) -> str:
        """The fair-share sweep's lock (one worker at a time looks at the slots)."""
        return self._fair("sweeper")

    # -- Celery -------------------------------------------------------------
    @property
    def turn_queue(self) -> str:
        return f"{self.prefix}.turns"

    @property
    def tool_queue(self) -> str:
        """Calls any tool worker can answer (a tool the spec does not allow: UnknownTool)."""
        return f"{self.prefix}.tools"

    def tool_queue_of(self, tool: str) -> str:
        """Calls of one tool: consumed only by workers that have it."""
        return f"{self.prefix}.tools.{tool}"

    @property
    def broker_prefix(self) -> str:
        """kombu's ``global_keyprefix``: keeps deployments sharing a Redis apart."""
        return f"{self.prefix}:celery:"


def call_key(iteration: int, index: int) -> str:
    """Deterministic id of a tool call inside its run."""
    return f"{iteration}.{index}"


def parse_call_key(key: str) -> tuple[int, int]:
    iteration, index = key.split(".")
    return int(iteration), int(index)
