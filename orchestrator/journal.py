"""The run's journal: per turn, what fork and replay need that the history does not keep.

One hash per run (``keys.journal``), expired with the run's other keys:

- ``t<N>``: turn N, written with its reply in the same script (``RECORD_REPLY``): the
  attempt stages its entry as ``p<N>:<owner>`` first (``stage``), and the script keeps it as
  ``t<N>`` only when it records that attempt's reply, so an entry is never a discarded
  attempt's. It holds the tokens and cost spent before the turn, the length of the history
  when the turn began, the operator steers the turn drained, a digest of the request (the
  conversation the model got and the model's name; see ``request_info``), the reply as
  received (content, tool calls, usage; scrubbed) and the turn's compaction summaries.
- ``c<N>.<k>``: the k-th compaction of turn N, written by ``COMPACT`` in the same step: the
  messages it took out of the history (a fork before turn N puts them back).
- ``s<digest>``: a set of tool schemas the model was offered, once per run and set.

Entries are small (previews of at most ``PREVIEW_CHARS``, no history), except what
compaction takes out, which the history held until then. Everything is scrubbed: secrets
masked as in the run's stored messages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.bounds import ERROR_MAX_CHARS, REPLY_MAX_CHARS, cut_text
from orchestrator.scrub import scrub_text

if TYPE_CHECKING:
    from orchestrator.store import RunStore

log = logging.getLogger(__name__)

PREVIEW_CHARS = 300  # of one message, in a request's digest
SEALED_FIELD = "tooloop_sealed"  # worker/protect.py: a stored message's sealed original
OPERATOR_STEER = "Guidance from your operator. "  # orchestrator/store.py steer_message's first words
_ISO_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?")
_UUID = re.compile(r"\b[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\b")

# Stage an entry only while the run lives: a late attempt never leaves a key without expiry.
# KEYS: the run's state, its journal. ARGV: field, entry, tool set field ('' none), tool set
STAGE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'aborted' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('HSETNX', KEYS[2], ARGV[3], ARGV[4]) end
return 1
"""


# -- what a request looked like ---------------------------------------------------------------
def normalise(text: str, run_id: str = "") -> str:
    """What is expected to differ between a run and its replay: the run's folder and id,
    times, uuids."""
    if run_id and run_id in text:
        text = re.sub(r"(?:/[^\s\"'/\\]+)*/" + re.escape(run_id) + r"\b", "<run_dir>", text)
        text = text.replace(run_id, "<run_id>")
    return _UUID.sub("<uuid>", _ISO_TIME.sub("<time>", text))


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = json.dumps(content, sort_keys=True)
    # tool results and replies are stored scrubbed; a prompt, steering or steer may not be
    return scrub_text(text) if message.get("role") in ("system", "user") else text


def canonical(message: dict[str, Any], run_id: str = "") -> str:
    """A message as compared: role, text, the calls it makes; call ids left out (they are
    the model's own names; a replay serves them again)."""
    calls = [[(c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")]
             for c in message.get("tool_calls") or []]  # fmt: skip
    body = json.dumps([message.get("role"), _content(message), calls], sort_keys=True)
    return normalise(body, run_id)


def _digest(text: str, size: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def preview(message: dict[str, Any], run_id: str = "") -> str:
    text = _content(message)
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += f"\n-> {fn.get('name')}({fn.get('arguments') or ''})"
    return cut_text(normalise(text.strip(), run_id), PREVIEW_CHARS)


def request_info(model: str, messages: list[dict[str, Any]], run_id: str = "") -> dict[str, Any]:
    """A request's digest: the model's name, the number of messages, and each message since
    the last reply (the ones a turn adds; turn 1's are the system prompt and the task) with
    a digest and a preview. Every message of a history is in one turn's tail (compaction's
    summary aside, which a replay serves from the cassette), so comparing tails turn by turn
    compares the whole conversation, at a cost per turn of what the turn added."""
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    start = replies[-1] if replies else 0
    tail = [{"i": i, "role": messages[i].get("role"), "digest": _digest(canonical(messages[i], run_id)),
             "text": preview(messages[i], run_id)} for i in range(start, len(messages))]  # fmt: skip
    whole = _digest(json.dumps([model, len(messages), [item["digest"] for item in tail]]), 32)
    return {"model": model, "n": len(messages), "digest": whole, "tail": tail}


def first_difference(recorded: dict[str, Any], now: dict[str, Any],
                     new_only: bool = False) -> tuple[Any, Any] | None:  # fmt: skip
    """Where two requests part: (recorded, now) as shown in a report, or None. The model's
    name, then each message since the last reply, then the number of messages.
    ``new_only``: only the messages since the last reply (an earlier difference was found
    at an earlier turn already, and every later request carries it)."""
    if recorded.get("digest") == now.get("digest"):
        return None
    if recorded.get("model") != now.get("model") and not new_only:
        return {"model": recorded.get("model")}, {"model": now.get("model")}
    old = {item["i"]: item for item in recorded.get("tail") or []}
    new = {item["i"]: item for item in now.get("tail") or []}
    for i in sorted(set(old) | set(new)):
        a, b = old.get(i), new.get(i)
        if a is None or b is None or a["digest"] != b["digest"]:
            return _shown(i, a), _shown(i, b)
    if new_only or recorded.get("n") == now.get("n"):
        return None
    return {"messages": recorded.get("n")}, {"messages": now.get("n")}


def _shown(index: int, item: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if item is None else {"message": index, "role": item["role"], "text": item["text"]}


def operator_steers(messages: list[dict[str, Any]]) -> list[str]:
    """The operator's steer texts a turn drained when it began: system messages after the
    last reply (supervisor and judge steers are the loop's own: a replay makes them again)."""
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    tail = messages[replies[-1] + 1 :] if replies else messages
    texts = [str(m.get("content") or "") for m in tail if m.get("role") == "system"]
    return [scrub_text(t.split("\n", 1)[-1]) for t in texts if t.startswith(OPERATOR_STEER)]


def received(message: dict[str, Any]) -> dict[str, Any]:
    """A reply as received, scrubbed. One too large to keep (the run refused it) is kept as
    a cut copy and its size (``oversize``): a replay serves it at that size again, and Redis
    never holds more of it than of any refused reply (``ERROR_MAX_CHARS``)."""
    calls = message.get("tool_calls") or []
    size = len(message.get("content") or "") + sum(len((c.get("function") or {}).get("arguments") or "")
                                                   for c in calls)  # fmt: skip
    limit = ERROR_MAX_CHARS if size > REPLY_MAX_CHARS else REPLY_MAX_CHARS
    content = message.get("content")
    out: dict[str, Any] = {"content": scrub_text(content[:limit]) if isinstance(content, str) else content}
    kept = []
    for call in calls:
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        kept.append({"id": call.get("id"), "type": call.get("type") or "function",
                     "function": {"name": fn.get("name"),
                                  "arguments": scrub_text(arguments[:limit]) if isinstance(arguments, str)
                                  else arguments}})  # fmt: skip
    if kept:
        out["tool_calls"] = kept
    if size > REPLY_MAX_CHARS:
        out["oversize"] = size
    return out


def _reply(reply: Any) -> dict[str, Any]:
    """A worker's ``llm.Reply``, as the journal keeps it."""
    return {**received(reply.message), "usage": reply.usage or {"total_tokens": reply.tokens},
            "model": reply.model, "served": reply.served, "cost_usd": reply.cost_usd}  # fmt: skip


# -- the worker's side -----------------------------------------------------------------------
@dataclass
class TurnNotes:
    """What one attempt of a turn notes as it goes; staged with its reply (``stage``)."""

    run_id: str
    iteration: int
    tokens_before: int
    cost_before: float
    start: int  # messages in the history when the turn began (steers drained included)
    steers: list[str]
    request: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    compactions: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def begin(cls, run_id: str, iteration: int, tokens: int, cost: float,
              messages: list[dict[str, Any]]) -> TurnNotes:  # fmt: skip
        return cls(run_id, iteration, tokens, cost, len(messages), operator_steers(messages))

    def requested(self, model: str, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> None:  # fmt: skip
        self.request, self.tools = request_info(model, messages, self.run_id), tools

    def compacted(self, reason: str, done: Any) -> None:
        """A compaction of this turn (``worker.compaction.Compacted``) that was stored."""
        summary = str(done.summary.get("content") or "")
        note: dict[str, Any] = {"reason": reason, "fallback": done.fallback, "tokens": done.tokens,
                                "cost_usd": done.cost_usd, "summary": scrub_text(summary)}  # fmt: skip
        if done.reply is not None:
            note["reply"] = _reply(done.reply)
        self.compactions.append(note)

    def entry(self, reply: Any) -> dict[str, Any]:
        return {"iteration": self.iteration, "tokens_before": self.tokens_before,
                "cost_before": self.cost_before, "start": self.start, "steers": self.steers,
                "request": self.request, "tools": tools_digest(self.tools), "reply": _reply(reply),
                "compactions": self.compactions}  # fmt: skip


def tools_digest(tools: list[dict[str, Any]] | None) -> str:
    return _digest(json.dumps(tools or [], sort_keys=True))


_staged_sets: set[tuple[str, str]] = set()  # (run, tool set) this process staged already


def stage(store: RunStore, owner: str, notes: TurnNotes, reply: Any) -> None:
    """Stage the entry of this attempt; ``RECORD_REPLY`` keeps it with the reply. Best
    effort: a journal that cannot be written never fails the turn."""
    try:
        entry = notes.entry(reply)
        digest = entry["tools"]
        fresh = (notes.run_id, digest) not in _staged_sets
        args = [f"p{notes.iteration}:{owner}", json.dumps(entry), f"s{digest}" if fresh else "",
                json.dumps(notes.tools or []) if fresh else ""]  # fmt: skip
        keys = [store.keys.run(notes.run_id), store.keys.journal(notes.run_id)]
        _script(store)(keys=keys, args=args)
        if fresh:
            if len(_staged_sets) > 10_000:
                _staged_sets.clear()
            _staged_sets.add((notes.run_id, digest))
    except Exception:
        log.warning("turn %s/%d: its journal entry was not staged", notes.run_id, notes.iteration,
                    exc_info=True)  # fmt: skip


def _script(store: RunStore) -> Any:
    script = store.__dict__.get("_journal_stage")
    if script is None:
        script = store.__dict__["_journal_stage"] = store.redis.register_script(STAGE)
    return script


# -- reading ---------------------------------------------------------------------------------------
@dataclass
class Compaction:
    iteration: int
    k: int
    head: int
    inserted: int
    removed: list[dict[str, Any]]


@dataclass
class Journal:
    turns: dict[int, dict[str, Any]] = field(default_factory=dict)
    compactions: list[Compaction] = field(default_factory=list)  # in the order they happened
    tool_sets: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    raw: dict[str, str] = field(default_factory=dict)  # every field as stored (a fork copies some)


def parse(raw: dict[Any, Any]) -> Journal:
    journal = Journal()
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        text = value.decode() if isinstance(value, bytes) else str(value)
        journal.raw[name] = text
        try:
            if name.startswith("t"):
                journal.turns[int(name[1:])] = json.loads(text)
            elif name.startswith("c"):
                iteration, k = name[1:].split(".")
                data = json.loads(text)
                removed = data.get("removed") or []
                journal.compactions.append(Compaction(int(iteration), int(k), int(data["head"]),
                                                      int(data["inserted"]),
                                                      [json.loads(m) for m in removed]))  # fmt: skip
            elif name.startswith("s"):
                journal.tool_sets[name[1:]] = json.loads(text)
        except (ValueError, KeyError, TypeError):
            log.warning("journal field %s does not parse; ignored", name)
    journal.compactions.sort(key=lambda c: (c.iteration, c.k))
    return journal


def read(store: RunStore, run_id: str) -> Journal:
    return parse(store.redis.hgetall(store.keys.journal(run_id)))


def undo(messages: list[dict[str, Any]], compactions: list[Compaction]) -> list[dict[str, Any]]:
    """The history with these compactions put back, latest first (each replaced
    ``removed`` by ``inserted`` messages at ``head``; the history only grew after it)."""
    out = list(messages)
    for c in sorted(compactions, key=lambda c: (c.iteration, c.k), reverse=True):
        out = out[: c.head] + c.removed + out[c.head + c.inserted :]
    return out


def history_at(messages: list[dict[str, Any]], journal: Journal, at: int,
               last_reply: int) -> list[dict[str, Any]]:  # fmt: skip
    """The history as it stood when turn ``at`` began (``last_reply``: the last turn whose
    reply the history holds): compactions of turns ``at`` and later put back, then cut
    where turn ``at`` began (its entry says where; else before its reply, counted back
    from the last one)."""
    full = undo(messages, [c for c in journal.compactions if c.iteration >= at])
    entry = journal.turns.get(at)
    if entry is not None and isinstance(entry.get("start"), int):
        return full[: entry["start"]]
    back = last_reply - at + 1  # turn `at`'s reply is this many replies from the end
    if back <= 0:
        return full
    replies = [i for i, m in enumerate(full) if m.get("role") == "assistant"]
    if back > len(replies):
        raise LookupError(f"the history before turn {at} is no longer kept")
    return full[: replies[-back]]
