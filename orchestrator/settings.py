"""Deployment settings, read from the environment (prefix ``TOOLOOP_``)."""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from orchestrator.keys import EVENTS_MAXLEN

# No internet on many deployments: litellm must not try to fetch its cost map.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLOOP_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    key_prefix: str = "tooloop"
    tools: str = ""  # comma-separated modules that register tools
    sandbox_root: str = Field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "tooloop"))
    api_tokens: str = ""  # "token=tenant,token2=tenant2"
    secret_key: str = ""  # encrypts literal api keys at rest; see orchestrator.secrets
    recovery_s: float = 60.0  # bound on resuming a run whose worker died
    retention_s: int = 7 * 24 * 3600  # finished runs expire after this
    events_maxlen: int = EVENTS_MAXLEN  # progress events kept per run
    sandbox: str = "auto"  # auto | bwrap | basic: strongest layer to use
    agents_dir: str = "agents"  # steering files and skills; relative = from the submitter's cwd

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def tool_modules(self) -> list[str]:
        return [m.strip() for m in self.tools.split(",") if m.strip()]

    @property
    def lease_s(self) -> float:
        """A claimed step whose heartbeat stops is presumed lost after this long."""
        return self.recovery_s / 2

    @property
    def sweep_interval_s(self) -> float:
        return max(0.5, self.recovery_s / 12)

    @property
    def heartbeat_s(self) -> float:
        return max(0.2, self.lease_s / 4)

    def tenant_tokens(self) -> dict[str, str]:
        pairs = (p.split("=", 1) for p in self.api_tokens.split(",") if "=" in p)
        return {token.strip(): tenant.strip() for token, tenant in pairs}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
