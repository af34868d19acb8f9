"""Every Redis key, queue name and TTL tooloop uses, in one place.

Per-run keys share the hash tag ``{run_id}``, so the Lua scripts that update
several of them at once stay atomic on Redis Cluster too. Global keys (the run
index, the lease index, the worker registry) are only ever touched on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

EVENTS_MAXLEN = 1000  # default progress events kept per run (approximate trim)
WORKER_TTL_S = 30  # a worker not seen for this long is not live
CATALOG_REFRESH_S = 10  # workers re-publish their catalog this often


@dataclass(frozen=True)
class Keys:
    prefix: str

    # -- one run ------------------------------------------------------------
    def _run(self, run_id: str, part: str) -> str:
        return f"{self.prefix}:run:{{{run_id}}}:{part}"

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
        """Hash ``<iteration>.<index>`` -> ``q|deadline`` / ``s|deadline`` / ``d``."""
        return self._run(run_id, "callstate")

    def call_args(self, run_id: str) -> str:
        """Hash ``<iteration>.<index>`` -> tool task payload (for re-dispatch)."""
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

    def all_for_run(self, run_id: str) -> list[str]:
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
        ]

    # -- global -------------------------------------------------------------
    def runs(self) -> str:
        """Sorted set run_id -> created_at (ms): `tooloop list`."""
        return f"{self.prefix}:runs"

    def tenant_runs(self, tenant: str) -> str:
        """Sorted set run_id -> created_at (ms), one per tenant: the operator API's list."""
        return f"{self.prefix}:tenant:{tenant}:runs"

    def leases(self) -> str:
        """Sorted set run_id -> when the sweeper should look at the run (ms)."""
        return f"{self.prefix}:leases"

    def workers(self) -> str:
        """Hash worker name -> JSON {seen, queues, tools: [ToolDef...]}."""
        return f"{self.prefix}:workers"

    def sweep_lock(self) -> str:
        return f"{self.prefix}:sweeper"

    # -- Celery -------------------------------------------------------------
    @property
    def turn_queue(self) -> str:
        return f"{self.prefix}.turns"

    @property
    def tool_queue(self) -> str:
        return f"{self.prefix}.tools"

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
