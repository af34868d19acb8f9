"""Progress events as typed models: one pydantic class per ``type``.

The run's event stream (``keys.events``) holds flat string fields, written by the Lua
scripts (``event(...)`` in ``orchestrator/scripts.py`` and ``orchestrator/approvals.py``).
Readers never see those strings: ``parse`` turns a stream entry into its class, with
numbers as ``int``, flags as ``bool`` and times (ms since the epoch in the stream) as
aware ``datetime``. ``model_dump(mode="json")`` is what the API's server-sent events
carry, and ``validate`` reads that JSON back into the same model.

An event a reader does not know (a newer worker's type, or a known type whose fields
no longer fit) comes as a plain ``Event`` with its fields kept as they were, so an old
reader never breaks on a new writer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Tag, TypeAdapter, ValidationError

from orchestrator.models import Status

log = logging.getLogger(__name__)


def _from_ms(value: Any) -> Any:
    """The stream writes ms since the epoch; JSON (the API's SSE) has ISO 8601 text."""
    if isinstance(value, int | float) or (isinstance(value, str) and value.isdigit()):
        return datetime.fromtimestamp(int(value) / 1000, tz=UTC)
    return value


Time = Annotated[datetime, BeforeValidator(_from_ms)]


class Event(BaseModel):
    """Any progress event; an unknown ``type`` is read as this class, fields as they came."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str  # the stream entry's id (``<ms>-<seq>``): the SSE id and Last-Event-ID
    type: str
    ts: Time  # when Redis recorded it


class _Known(Event):
    # A newer writer's extra field on a known type is dropped: the typed fields are the API.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Queued(_Known):
    """The run was written."""

    type: Literal["queued"] = "queued"


class Iteration(_Known):
    """A model reply was recorded."""

    type: Literal["iteration"] = "iteration"
    iteration: int
    tool_calls: int
    tokens_used: int
    cost_usd: float = 0.0  # the run's cost so far (USD): a turn's cost is the difference
    corrected: bool = False  # the reply broke the outcome contract and was sent back once


class ToolCall(_Known):
    """A tool call was recorded."""

    type: Literal["tool_call"] = "tool_call"
    iteration: int
    tool: str
    success: bool


class Control(_Known):
    """A directive was recorded (``pause``, ``resume``, ``abort``, ``steer``) or applied
    (``steer_applied``: ``count`` steer messages joined the history)."""

    type: Literal["control"] = "control"
    action: str
    by: str | None = None
    count: int | None = None


class Supervisor(_Known):
    """A rule, loop detector or the judge acted."""

    type: Literal["supervisor"] = "supervisor"
    rule: str  # tool_repeated, budget_fraction, iteration_reached, loop_repeat, loop_pingpong, judge
    action: str  # pause, steer, abort, none
    iteration: int
    verdict: str | None = None  # the judge's: passed, failed, error
    error_type: str | None = None  # why the judge call failed


class Recovery(_Known):
    """A lost step was sent again."""

    type: Literal["recovery"] = "recovery"
    step: str  # turn, tool_calls
    iteration: int
    count: int | None = None  # tool_calls: how many calls were sent again
    lost_since: Time | None = None  # when its lease lapsed (tool_calls: the earliest of theirs)


class Discarded(_Known):
    """A reply of a turn taken over (or of a failed attempt) was billed, not recorded."""

    type: Literal["discarded"] = "discarded"
    iteration: int
    tokens: int
    tokens_used: int


class Compaction(_Known):
    """The history was compacted."""

    type: Literal["compaction"] = "compaction"
    iteration: int
    before: int  # messages
    after: int
    reason: str  # threshold, context_window
    fallback: bool  # the summary call failed: a cut transcript stands in
    tokens_used: int


class RateLimited(_Known):
    """A turn went back to the queue to wait for rate-limit capacity."""

    type: Literal["rate_limited"] = "rate_limited"
    iteration: int
    wait_ms: int


class Waiting(_Known):
    """The run waits in its tenant's queue for a slot (orchestrator/fairshare.py): it holds
    no worker and no message; its status reason is ``reason`` until it is admitted."""

    type: Literal["waiting"] = "waiting"
    reason: str  # waiting_share


class Admitted(_Known):
    """The run waited for its tenant's share and now holds a slot: its turn is sent."""

    type: Literal["admitted"] = "admitted"
    waited_ms: int


class Text(_Known):
    """A piece of the model's streamed reply (scrubbed)."""

    type: Literal["text"] = "text"
    iteration: int
    text: str


class Approval(_Known):
    """A call waits for a person's decision (``pending``), or was ``approved``/``denied``."""

    type: Literal["approval"] = "approval"
    iteration: int
    call_id: str
    tool: str
    decision: str  # pending, approved, denied
    arguments: str | None = None  # pending: the call's arguments, JSON text, scrubbed, bounded
    deadline: Time | None = None  # pending: when it is denied without a decision
    by: str | None = None  # decided: who (``timeout`` for a timed-out call)
    reason: str | None = None  # decided


class Child(_Known):
    """A call of a child agent started a child run (orchestrator/children.py)."""

    type: Literal["child"] = "child"
    iteration: int
    call_id: str
    agent: str
    child: str  # the child run's id


class Forked(_Known):
    """The run is a fork: its history up to turn ``iteration`` is ``parent``'s, its first
    turn is ``iteration`` (orchestrator/fork.py)."""

    type: Literal["forked"] = "forked"
    parent: str
    iteration: int
    by: str | None = None  # who forked it (cli:..., api:<tenant>, console:<tenant>)
    model: str | None = None  # set when the fork runs another model than its parent
    prompt_appended: bool = False  # an instruction was appended to the history


class ForkWarning(_Known):
    """Calls before the fork's first turn were not idempotent: their effects happened for
    the parent (its sandbox folder, the world outside), and the fork neither repeats nor
    undoes them; its own sandbox folder starts empty."""

    type: Literal["fork_warning"] = "fork_warning"
    iteration: int
    calls: int  # calls before ``iteration`` whose tools are not idempotent
    tools: str  # their tools' names, comma-separated


class Outcome(_Known):
    """The run ended; always its last event."""

    type: Literal["outcome"] = "outcome"
    iteration: int
    exit: str  # an outcome enum value, default, or a reserved exit
    status: Status


_CLASSES: tuple[type[Event], ...] = (Queued, Iteration, ToolCall, Control, Supervisor, Recovery,
                                     Discarded, Compaction, RateLimited, Waiting, Admitted, Text,
                                     Approval, Child, Forked, ForkWarning, Outcome)  # fmt: skip
KINDS: dict[str, type[Event]] = {cls.model_fields["type"].default: cls for cls in _CLASSES}
UNKNOWN = "*"


def _kind(data: Any) -> str:
    kind = data.get("type") if isinstance(data, Mapping) else getattr(data, "type", None)
    return kind if kind in KINDS else UNKNOWN


AnyEvent = Annotated[
    Annotated[Queued, Tag("queued")]
    | Annotated[Iteration, Tag("iteration")]
    | Annotated[ToolCall, Tag("tool_call")]
    | Annotated[Control, Tag("control")]
    | Annotated[Supervisor, Tag("supervisor")]
    | Annotated[Recovery, Tag("recovery")]
    | Annotated[Discarded, Tag("discarded")]
    | Annotated[Compaction, Tag("compaction")]
    | Annotated[RateLimited, Tag("rate_limited")]
    | Annotated[Waiting, Tag("waiting")]
    | Annotated[Admitted, Tag("admitted")]
    | Annotated[Text, Tag("text")]
    | Annotated[Approval, Tag("approval")]
    | Annotated[Child, Tag("child")]
    | Annotated[Forked, Tag("forked")]
    | Annotated[ForkWarning, Tag("fork_warning")]
    | Annotated[Outcome, Tag("outcome")]
    | Annotated[Event, Tag(UNKNOWN)],
    Discriminator(_kind),
]
_ADAPTER: TypeAdapter[Event] = TypeAdapter(AnyEvent)


def validate(data: Mapping[str, Any]) -> Event:
    """The event's model, from its stream fields (strings) or its JSON (``model_dump``).
    Fields that do not fit their known type give a plain ``Event``: a reader goes on."""
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        log.warning("event %s (%s) does not fit its type: %s", data.get("id"), data.get("type"),
                    exc.errors(include_url=False))  # fmt: skip
        return Event.model_validate(data)


def parse(event_id: str, fields: Mapping[str, str]) -> Event:
    """A stream entry (id, decoded fields) as its typed event."""
    return validate({**fields, "id": event_id})
