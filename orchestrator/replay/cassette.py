"""A cassette: one ended run, as JSON lines, enough to run its loop again offline.

::

    {"type": "header", "format": 1, "tooloop": "0.1.0", "run_id": ..., "spec": {...},
     "tools": [schemas offered], "start": null | {"iteration", "messages", "tokens_used", "cost_usd"},
     "forked_from": null | {"run_id", "iteration"}}
    {"type": "turn", "iteration": N, "request": {digest}, "reply": {content, tool_calls, usage, ...},
     "steers": [...], "compactions": [...], "tokens_before": ..., "error": null | {"type", "message"}}
    {"type": "call", "iteration": N, "index": i, "record": {ToolCallRecord}, "message": "what the
     model read", "approval": null | {"decision", "reason", "by"}}
    {"type": "end", "result": {RunResult}}

The spec keeps no credential: sealed values and credential parameters are dropped, and
every line is scrubbed like what a run stores (``orchestrator/scrub.py``). ``start`` is set
for a fork: its loop starts at that turn, from that history (as the fork did).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.credentials import is_endpoint
from orchestrator.scrub import scrub_value
from orchestrator.secrets import HEADER_PARAMS, is_credential, is_sealed

FORMAT = 1
SEALED_FIELD = "tooloop_sealed"  # worker/protect.py: a stored message's sealed original


class CassetteError(ValueError):
    """A file that is not a cassette this version can replay."""


@dataclass
class Cassette:
    header: dict[str, Any]
    turns: dict[int, dict[str, Any]] = field(default_factory=dict)
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<iteration>.<index>" -> line
    end: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> dict[str, Any]:
        return self.header["spec"]

    @property
    def first_turn(self) -> int:
        start = self.header.get("start")
        return int(start["iteration"]) if start else 1

    @property
    def result(self) -> dict[str, Any]:
        return self.end.get("result") or {}

    def lines(self) -> list[dict[str, Any]]:
        ordered = sorted(self.calls.values(), key=lambda c: (c["iteration"], c["index"]))
        return [self.header, *(self.turns[n] for n in sorted(self.turns)), *ordered, self.end]


def load(path: str | Path) -> Cassette:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CassetteError(f"{path}: {exc}") from None
    cassette: Cassette | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            kind = line["type"]
        except (ValueError, KeyError, TypeError):
            why = "not a cassette line (one JSON object with a `type`)"
            raise CassetteError(f"{path}:{number}: {why}") from None
        if kind == "header":
            if line.get("format") != FORMAT:
                why = f"cassette format {line.get('format')!r}; this tooloop reads {FORMAT}"
                raise CassetteError(f"{path}: {why}")
            cassette = Cassette(line)
        elif cassette is None:
            raise CassetteError(f"{path}:{number}: a cassette starts with its header")
        elif kind == "turn":
            cassette.turns[int(line["iteration"])] = line
        elif kind == "call":
            cassette.calls[f"{line['iteration']}.{line['index']}"] = line
        elif kind == "end":
            cassette.end = line
    if cassette is None or not cassette.end:
        raise CassetteError(f"{path}: no header or no end line: not a whole cassette")
    return cassette


def dumps(cassette: Cassette) -> str:
    """The cassette's text: one line per object, every value scrubbed once more."""
    return "".join(json.dumps(scrub_value(line), ensure_ascii=False) + "\n" for line in cassette.lines())


def save(cassette: Cassette, path: str | Path) -> None:
    Path(path).write_text(dumps(cassette), encoding="utf-8")


# -- what a cassette may hold ---------------------------------------------------------------------
def clean_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A stored spec without a secret: sealed values, credential parameters and headers dropped
    (in ``model_params`` and the judge's), the rest scrubbed."""
    out = drop_sealed(spec)
    out["model_params"] = clean_params(out.get("model_params") or {})
    judge = (out.get("supervisor") or {}).get("judge")
    if isinstance(judge, dict):
        judge["model_params"] = clean_params(judge.get("model_params") or {})
    return scrub_value(out)


def clean_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if not is_credential(k) and k not in HEADER_PARAMS}


def replay_params(params: dict[str, Any], api_base: str) -> dict[str, Any]:
    """A cassette's params as the replay runs them: its own endpoint (a literal key of no
    worth: the spec brings its own, so no operator credential is asked for), no retries."""
    kept = {k: v for k, v in clean_params(params).items()
            if not is_endpoint(k) and k not in ("api_key_env", "num_retries", "max_retries")}  # fmt: skip
    return {**kept, "api_base": api_base, "api_key": "replay", "num_retries": 0}


def drop_sealed(value: Any) -> Any:
    """``value`` without sealed strings (dropped from dicts and lists) or sealed originals."""
    if isinstance(value, dict):
        return {k: drop_sealed(v) for k, v in value.items() if k != SEALED_FIELD and not is_sealed(v)}
    if isinstance(value, list):
        return [drop_sealed(v) for v in value if not is_sealed(v)]
    return value
