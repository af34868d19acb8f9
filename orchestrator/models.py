"""The public data: run specs, results and tool-call records (pydantic)."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from orchestrator.bounds import STEER_MAX_CHARS
from orchestrator.http_tools import HttpTool
from orchestrator.scalars import Bool, Float, Int


class Status(StrEnum):
    queued = "queued"  # written, first turn not started yet
    running = "running"  # a turn or a tool call is in flight or due
    paused = "paused"  # parked in Redis; nothing starts until resume
    completed = "completed"  # ended on `default` or an outcome enum value
    failed = "failed"  # ended on max_iterations, budget_exceeded or error
    aborted = "aborted"  # ended by an abort directive

    @property
    def ended(self) -> bool:
        return self in (Status.completed, Status.failed, Status.aborted)


class Exit(StrEnum):
    default = "default"  # normal end, no outcome enum
    max_iterations = "max_iterations"  # turn cap reached
    budget_exceeded = "budget_exceeded"  # token budget spent
    error = "error"  # model/API error, or an answer outside the outcome contract
    aborted = "aborted"  # abort directive


RESERVED_EXITS = frozenset(e.value for e in Exit)
LIMIT_EXITS = frozenset({Exit.max_iterations.value, Exit.budget_exceeded.value})


def status_for_exit(exit_: str) -> Status:
    if exit_ == Exit.aborted:
        return Status.aborted
    if exit_ in RESERVED_EXITS and exit_ != Exit.default:
        return Status.failed
    return Status.completed


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Outcome(_Strict):
    enum: list[str] = Field(min_length=1)

    @field_validator("enum")
    @classmethod
    def _closed_set(cls, values: list[str]) -> list[str]:
        if any(not v.strip() for v in values):
            raise ValueError("outcome values must be non-empty strings")
        if len(set(values)) != len(values):
            raise ValueError("outcome values must be unique")
        clash = sorted(set(values) & RESERVED_EXITS)
        if clash:
            raise ValueError(f"outcome values {clash} collide with reserved exits")
        return values


class RunContext(_Strict):
    plan_id: str | None = None
    phase: str | None = None
    sandbox_root: str | None = None  # the run's folder itself, when given
    automation_profile: str | None = None
    resource_bindings: dict[str, Any] = Field(default_factory=dict)
    project_resources: Any = None


Action = Literal["pause", "steer", "abort"]

# The options each kind of rule reads; any other option on that rule is refused.
RULE_OPTIONS = {
    "tool_repeated": {"count", "tool"},
    "budget_fraction": {"gt"},
    "iteration_reached": {"gte"},
}


class SupervisorRule(_Strict):
    """One deterministic rule; it fires at most once per run (see orchestrator/supervisor.py)."""

    when: Literal["tool_repeated", "budget_fraction", "iteration_reached"]
    then: Action
    count: Int = Field(default=3, ge=2)  # tool_repeated: identical calls in a row
    tool: str | None = None  # tool_repeated: only this tool
    gt: Float = Field(default=0.8, gt=0, le=1)  # budget_fraction: of token_budget
    gte: Int | None = Field(default=None, ge=1)  # iteration_reached
    # steer text (abort: the reason, cut to REASON_MAX_CHARS); a default otherwise
    message: str | None = Field(default=None, max_length=STEER_MAX_CHARS)

    @model_validator(mode="after")
    def _complete(self) -> SupervisorRule:
        if self.when == "iteration_reached" and self.gte is None:
            raise ValueError("iteration_reached needs `gte`")
        # Set and not the default: the stored spec (model_dump_json) carries every field.
        ignored = {
            name
            for name in self.model_fields_set - RULE_OPTIONS[self.when] - {"when", "then", "message"}
            if getattr(self, name) != type(self).model_fields[name].default
        }
        if ignored:
            names = ", ".join(f"`{n}`" for n in sorted(ignored))
            raise ValueError(f"{names} does not apply to `when: {self.when}`")
        if self.message is not None and not self.message.strip():
            raise ValueError("`message` must not be blank")
        return self


class JudgeSpec(_Strict):
    model: str  # any litellm model string
    model_params: dict[str, Any] = Field(default_factory=dict)  # api_base, api_key_env, ...
    every_n_iterations: Int = Field(default=1, ge=1)
    on_judge_error: Action | Literal["ignore"] = "ignore"  # timeout, bad JSON, API error
    timeout_s: Float = Field(default=30, gt=0, le=600)

    @field_validator("model")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class SupervisorSpec(_Strict):
    """Without this block no rule, detector or judge runs."""

    rules: list[SupervisorRule] = Field(default_factory=list)
    judge: JudgeSpec | None = None
    detect_loops: Bool = True  # same call + same result repeated, or two calls ping-ponging
    loop_count: Int = Field(default=3, ge=2)  # repeats (ping-pong: round trips) that make a loop
    loop_action: Action = "steer"


class SandboxPolicy(_Strict):
    """Per-run limits of every tool call (see docs/sandbox.md for what enforces each)."""

    network: Bool = False  # off: bwrap's empty netns, else Landlock (TCP) + seccomp (sockets)
    memory_mb: Int = Field(default=1024, ge=16)  # address space per tool process
    cpu_s: Int = Field(default=60, ge=1)  # CPU seconds per tool process
    max_processes: Int = Field(default=64, ge=1)  # processes+threads of a call (worker as root)
    max_file_mb: Int = Field(default=256, ge=1)
    max_disk_mb: Int = Field(default=1024, ge=1)  # the run's folder in all (worker/sandbox/quota.py)
    max_open_files: Int = Field(default=256, ge=16)
    allowed_commands: list[str] | None = None  # shell: first word must be one of these

    @field_validator("allowed_commands")
    @classmethod
    def _command_names(cls, names: list[str] | None) -> list[str] | None:
        bad = [n for n in names or [] if not n or n != n.strip() or any(c.isspace() for c in n)]
        if bad:
            raise ValueError(f"allowed_commands must be single words (program names): {bad}")
        return names


MAX_TOOL_CALLS_PER_TURN = 1000  # the ceiling a spec may raise max_tool_calls_per_turn to
MAX_DEPTH = 10  # the ceiling of max_depth: a tree of child runs is at most this deep
AGENT_TOOL_PREFIX = "agent__"  # a child agent's tool: agent__<name> (orchestrator/children.py)
AGENT_NAME = re.compile(r"[A-Za-z0-9_-]{1,57}")  # so agent__<name> is a valid function name


class RunSpec(_Strict):
    prompt: str
    model: str
    model_params: dict[str, Any] = Field(default_factory=dict)
    steering: str | None = None
    tools: list[str] = Field(default_factory=list)
    max_iterations: Int = Field(default=25, ge=1)
    token_budget: Int | None = Field(default=None, ge=1)
    tool_timeout_s: Float = Field(default=300, gt=0)
    outcome: Outcome | None = None
    context: RunContext = Field(default_factory=RunContext)
    tenant: str = "default"
    supervisor: SupervisorSpec | None = None
    pause_max_s: Float = Field(default=3600, gt=0)
    steering_files: list[str] = Field(default_factory=list)
    skills: list[str] = Field(default_factory=list)
    sandbox: SandboxPolicy = Field(default_factory=SandboxPolicy)
    scrub_model_input: Bool = True  # false: the model sees tool outputs with secrets unmasked
    context_tokens: Int | None = Field(default=None, ge=1000)  # compaction threshold (estimated)
    max_tool_output_chars: Int = Field(default=50_000, ge=1000)  # one tool result, as the model sees it
    fallbacks: list[str] = Field(default_factory=list)  # models tried in order, sharing model_params
    cost_budget_usd: Float | None = Field(default=None, gt=0)
    # HTTP calls the model may make (orchestrator/http_tools.py); paths of an agent's
    # tools/*.yaml are read at submit and stored inline
    http_tools: list[HttpTool | str] = Field(default_factory=list)
    approval: list[str] = Field(default_factory=list)  # tools whose calls wait for a person
    approval_timeout_s: Float = Field(default=24 * 3600, gt=0)  # then the call is denied
    # one reply asking for more calls ends the run on error (TooManyToolCalls), none run
    max_tool_calls_per_turn: Int = Field(default=32, ge=1, le=MAX_TOOL_CALLS_PER_TURN)
    # child runs (orchestrator/children.py): name -> a spec file's path, or an inline spec
    # without `prompt`; each is offered to the model as the tool agent__<name>(prompt)
    agents: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    max_depth: Int = Field(default=3, ge=0, le=MAX_DEPTH)  # levels of child runs below this run
    description: str | None = None  # a child spec's: its tool's description for the model
    _source: Path | None = PrivateAttr(default=None)  # the file it was read from (load_spec)

    @field_validator("agents")
    @classmethod
    def _agent_names(cls, agents: dict[str, Any]) -> dict[str, Any]:
        bad = [name for name in agents if not AGENT_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"agent names must match [A-Za-z0-9_-]{{1,57}}: {bad}")
        return agents

    @field_validator("prompt", "model", "tenant")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if reserved := [n for n in names if n.startswith(AGENT_TOOL_PREFIX)]:
            raise ValueError(f"{reserved}: names starting with {AGENT_TOOL_PREFIX} are child agents' "
                             "tools: declare them under `agents`")  # fmt: skip
        return names

    @field_validator("fallbacks")
    @classmethod
    def _fallback_models(cls, models: list[str]) -> list[str]:
        if any(not m.strip() for m in models):
            raise ValueError("fallback models must be non-empty model strings")
        return models

    @field_validator("model_params")
    @classmethod
    def _timeout(cls, params: dict[str, Any]) -> dict[str, Any]:
        timeout = params.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or timeout <= 0):  # fmt: skip
            raise ValueError("timeout must be a number of seconds > 0")
        return params


class ToolCallRecord(BaseModel):
    call_id: str
    tool_name: str
    inputs: Any = None
    output: Any = None
    duration_ms: float = 0.0
    success: bool
    error: str | None = None
    iteration: int


class ParentRef(BaseModel):
    """The run and the call a child run was started by."""

    run_id: str
    call_id: str
class ForkedFrom(BaseModel):
    """The run a fork was made from, and the turn it was made at (its own first turn)."""

    run_id: str
    iteration: int


class RunResult(BaseModel):
    run_id: str
    status: Status
    status_reason: str | None = None  # why a run not ended is not moving: waiting_share (fair share)
    exit: str | None = None
    content: str | None = None
    result: Any = None
    iterations: int = 0
    tokens_used: int = 0  # every model call: turns, compaction and judge
    tokens_compaction: int = 0  # of which compaction summaries
    tokens_judge: int = 0  # of which the supervisor's judge
    cost_usd: float = 0.0  # priced from litellm's cost data (0 for models it does not know)
    terminated_by_limit: bool = False
    error: str | None = None
    error_type: str | None = None
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    parent: ParentRef | None = None  # a child run: the run and call that started it
    children: list[str] = Field(default_factory=list)  # child runs started by this run's calls
    forked_from: ForkedFrom | None = None  # a fork's parent and turn (orchestrator/fork.py)

    @property
    def succeeded(self) -> bool:
        return self.status == Status.completed
