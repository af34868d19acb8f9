"""Deployment settings, read from the environment (prefix ``TOOLOOP_``)."""

from __future__ import annotations

import math
import os
import tempfile
from functools import lru_cache
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from orchestrator.keys import EVENTS_MAXLEN

# No internet on many deployments: litellm must not try to fetch its cost map.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

LEASE_MIN_S = 3.0  # the shortest lease of a deployment whose bound is over 6 s (Settings.lease_s)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLOOP_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    key_prefix: str = "tooloop"
    tools: str = ""  # comma-separated modules that register tools
    sandbox_root: str = Field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "tooloop"))
    sandbox_allow: str = ""  # comma-separated folders a spec's context.sandbox_root may lie inside
    shell_executors: str = ""  # programs a run's allowed_commands may name though they run code (python,make)
    api_tokens: str = ""  # "token=tenant,token2=tenant2"
    secret_key: str = ""  # seals credentials at rest, per tenant; see orchestrator.secrets
    # What a spec may ask of the worker's own credentials (see orchestrator.credentials):
    allowed_key_envs: str = "*_API_KEY"  # names or globs api_key_env may name; TOOLOOP_* never
    allowed_api_bases: str = ""  # URL prefixes a worker-held key may be sent to, besides the provider's
    tenant: str = ""  # a producer with a tenant submits only for that tenant
    recovery_s: float = 60.0  # bound on resuming a run whose worker died
    step_attempts: int = Field(default=3, ge=1)  # claims of one step before the run ends on error
    retention_s: int = 7 * 24 * 3600  # finished runs expire after this
    events_maxlen: int = EVENTS_MAXLEN  # progress events kept per run
    sandbox: str = "auto"  # auto | bwrap | basic: strongest layer to use
    agents_dir: str = "agents"  # steering files and skills; relative = from the submitter's cwd
    mcp_servers: str = ""  # path of an `mcpServers` JSON/YAML file: tools of MCP servers
    log_format: Literal["text", "json"] = "text"  # json: one object per line, tagged with the run
    trace_content: bool = False  # spans carry prompts and replies (scrubbed); off: no text of a run
    task_events: bool = False  # Celery task events always on (Flower turns them on by itself)
    rate_limits: str = ""  # JSON: per-model and per-tenant requests/tokens per minute (worker/ratelimit.py)
    # Tenant fair share (orchestrator/fairshare.py), checked here: a bad value stops the start.
    tenant_shares: str = ""  # "tenant=weight,...": each tenant's weight of model tokens (default 1)
    tenant_max_active: str = ""  # "tenant=N,...,*=N": runs of a tenant holding a slot at once
    max_active: int | None = Field(default=None, ge=1)  # runs of all tenants together (weights divide it)

    @field_validator("tenant_shares", "tenant_max_active")
    @classmethod
    def _fair_share_pairs(cls, value: str, info: ValidationInfo) -> str:
        name = info.field_name or ""
        parse_pairs(f"TOOLOOP_{name.upper()}", value, integer=name == "tenant_max_active")
        return value

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def tool_modules(self) -> list[str]:
        return [m.strip() for m in self.tools.split(",") if m.strip()]

    @property
    def lease_s(self) -> float:
        """A claimed step whose heartbeat stops is presumed lost after this long.

        A sixth of the recovery bound R: a lost step is sent again within a lease and a sweep
        interval (under a quarter of R), and a step lost twice in a row (the worker redoing it
        lost too, as ``bench/chaos.py``'s kills do) within two, under half of R; the rest is
        room for what its run also waits on (the step's own work before the loss, the queue
        in front of it, a worker's start, redoing it; docs/guarantees.md). With R / 4 such a
        step's run stood still 48.8 s of R = 60 s. At least LEASE_MIN_S, so that a loaded
        box's pauses do not cost a live holder its step, and never more than half of R (a
        short R in tests)."""
        return min(self.recovery_s / 2, max(LEASE_MIN_S, self.recovery_s / 6))

    @property
    def sweep_interval_s(self) -> float:
        """How often each worker sweeps (the workers share the shards): R / 20, at least 0.5 s."""
        return max(0.5, self.recovery_s / 20)

    @property
    def heartbeat_s(self) -> float:
        return max(0.2, self.lease_s / 4)

    @property
    def unroutable_s(self) -> float:
        """A call of a tool no live worker has published for this long is recorded failed."""
        return 5 * self.recovery_s

    def tenant_tokens(self) -> dict[str, str]:
        """``TOOLOOP_API_TOKENS`` as token -> tenant. A token listed twice would silently
        map to the last tenant: ValueError (never naming a token), as for an empty one."""
        tokens: dict[str, str] = {}
        pairs = [p.split("=", 1) for p in self.api_tokens.split(",") if "=" in p]
        for number, (token, tenant) in enumerate(pairs, 1):
            token, tenant = token.strip(), tenant.strip()
            if not token or not tenant:
                raise ValueError(f"TOOLOOP_API_TOKENS: entry {number} has an empty token or tenant")
            if token in tokens:
                raise ValueError(f"TOOLOOP_API_TOKENS: entry {number} repeats an earlier entry's token "
                                 "(each token names one tenant)")  # fmt: skip
            tokens[token] = tenant
        return tokens


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def parse_pairs(name: str, raw: str, integer: bool) -> dict[str, float]:
    """``tenant=value,…`` as a dict; ValueError naming the setting and the bad entry. Values
    are whole numbers >= 1 (``integer``: caps) or numbers > 0 (weights)."""
    out: dict[str, float] = {}
    for number, entry in enumerate((e.strip() for e in raw.split(",") if e.strip()), 1):
        tenant, sep, text = (part.strip() for part in entry.partition("="))
        if not sep or not tenant:
            raise ValueError(f"{name}: entry {number} ({entry!r}) is not tenant=value")
        if tenant in out:
            raise ValueError(f"{name}: tenant {tenant!r} is listed twice")
        wanted = "a whole number >= 1" if integer else "a number > 0"
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise ValueError(f"{name}: {tenant}={text!r}: {wanted} expected") from None
        if value < 1 if integer else not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}: {tenant}={text!r}: {wanted} expected")
        out[tenant] = value
    return out
