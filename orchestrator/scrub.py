"""Secret scrubbing of everything tooloop stores or shows: pure functions and a logging filter.

Two kinds of secrets are masked wherever text is kept (tool outputs and errors,
model replies, the final answer, streamed text, log lines, task arguments shown
in Flower):

- the value of a key/value pair whose key names a credential
  (``api_key=…``, ``"password": "…"``, ``Authorization: Bearer …``);
- known token shapes anywhere: ``sk-…``, ``sk-ant-…``, ``ghp_…``, ``AKIA…``,
  ``xox…`` (Slack), JWTs, and the password of a URL (``postgres://user:…@host``).

A masked value of 8 or more characters keeps its first 4 (enough to tell two
keys apart), then ``*[REDACTED]``; a shorter one becomes ``[REDACTED]``.
Scrubbing is idempotent, and ``scrub_value`` keeps a JSON value's type.
"""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "*[REDACTED]"
SHORT_MASK = "[REDACTED]"

_NAMES = (
    r"authorization|token|api[_-]?key|password|secret|user[_-]?key|bearer|credential"
    r"|set[_-]?cookie|cookie"
)
# A key naming a credential, possibly with a prefix (access_token, x-api-key, db_password)
# or a "key" suffix (secret_key); "tokens_used" or "max_tokens" are not credentials.
_KEY = rf"[A-Za-z0-9_-]*?(?:{_NAMES})(?:[_-]?key)?"
_QUOTE = r"""\\?["']?"""
_STOP = r"""\s"'`,;&<>{}\[\]()*\\"""
_VALUE = rf"(?!\[REDACTED\])[^{_STOP}]++(?!\*\[REDACTED\])"
_PAIR = re.compile(
    rf"(?P<key>\b{_KEY}){_QUOTE}(?P<sep>\s*[:=]\s*){_QUOTE}"
    rf"(?P<scheme>(?:bearer|basic|token|digest)\s+)?+(?P<value>{_VALUE})",
    re.IGNORECASE,
)
_TOKENS = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"sk-(?:ant-)?[A-Za-z0-9_-]{12,}"
    r"|(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]{20,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r")(?!\*\[REDACTED\])"
)
# user:password@ in a URL (postgres://app:pw@db/app)
_URL_PASSWORD = re.compile(r"(?<=://)(?P<user>[^/\s:@'\"]*):(?P<value>(?!\[REDACTED\])[^/\s@'\"*]++)(?=@)")
# Every key/value match holds one of these (folded); every token shape one of those.
_KEY_HINTS = ("authorization", "token", "key", "password", "secret", "bearer", "credential", "cookie")
_TOKEN_HINTS = ("sk-", "_", "AKIA", "ASIA", "xox", "eyJ")
PIECE_CHARS = 65_536
_SECRET_KEY = re.compile(rf"{_KEY}s?", re.IGNORECASE)  # a field name: plurals too


def mask(value: str) -> str:
    return value[:4] + MASK if len(value) >= 8 else SHORT_MASK


def scrub_text(text: str) -> str:
    """``text`` with credential values and token shapes masked.

    A long text is scrubbed in pieces of about ``PIECE_CHARS``, each cut at a whitespace
    and scrubbed together with the end of the previous one (``continued``): one regex pass
    holds the GIL throughout, and a 5 MB output in one pass starved the tool worker's
    heartbeat thread for seconds (its call was declared lost).
    """
    if not text:
        return text
    if len(text) <= PIECE_CHARS:
        return _scrub(text)
    out, context = [], ""
    for piece in _pieces(text):
        clean = continued(context, piece)
        out.append(clean)
        context = tail_words(context + clean)
    return "".join(out)


def _scrub(text: str) -> str:
    # The key/value pattern costs ~0.4 us per character (case-insensitive alternation at every
    # position): it runs only where a credential name occurs. casefold() folds as re.IGNORECASE
    # does (long s, Kelvin sign), but for the dotted/dotless i, folded here by hand.
    folded = text.casefold().replace("\u0131", "i").replace("\u0307", "")
    if any(name in folded for name in _KEY_HINTS):
        text = _PAIR.sub(_mask_pair, text)
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m.group('user')}:{mask(m.group('value'))}", text)
    if any(start in text for start in _TOKEN_HINTS):
        text = _TOKENS.sub(lambda m: mask(m.group(0)), text)
    return text


def _pieces(text: str) -> list[str]:
    """``text`` in pieces of about PIECE_CHARS, each ending at a whitespace when one is near."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            space = max(text.rfind(c, end - 4096, end) for c in " \n\t")
            end = space + 1 if space > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


def continued(context: str, piece: str) -> str:
    """``piece`` scrubbed as the continuation of ``context`` (the end of the text before it,
    already scrubbed): a ``password: ...`` pair straddling the two is still masked. Scrubbing
    is idempotent, so the context comes back unchanged and is cut off again."""
    whole = _scrub(context + piece)
    if whole.startswith(context):
        return whole[len(context) :]
    return _scrub(piece)  # the context changed: mask the piece on its own


def tail_words(text: str, words: int = 3, limit: int = 200) -> str:
    """The end of a scrubbed text that a pattern continuing into the next piece may need."""
    return " ".join(text[-limit:].split(" ")[-words:])


def _mask_pair(match: re.Match[str]) -> str:
    start = match.start("value") - match.start()
    return match.group(0)[:start] + mask(match.group("value"))


def is_secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.fullmatch(name))


def scrub_value(value: Any) -> Any:
    """A JSON value with secrets masked; its type and shape stay (an int stays an int)."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, list):
        return [scrub_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _mask_all(v) if is_secret_key(str(k)) else scrub_value(v) for k, v in value.items()}
    return value


def _mask_all(value: Any) -> Any:
    """Under a field named like a credential every string is masked; numbers are left."""
    if isinstance(value, str):
        return value if value.endswith(MASK) or value == SHORT_MASK else mask(value)
    if isinstance(value, list):
        return [_mask_all(v) for v in value]
    if isinstance(value, dict):
        return {k: _mask_all(v) for k, v in value.items()}
    return value


class ScrubFilter(logging.Filter):
    """Masks secrets in a log record's message and traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string is the handler's problem, not ours
            return True
        clean = scrub_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub_text(record.exc_text)
        return True


def install_log_filter(*loggers: logging.Logger) -> None:
    """Put one ``ScrubFilter`` on every handler of these loggers (default: the root)."""
    for logger in loggers or (logging.getLogger(),):
        for handler in logger.handlers:
            if not any(isinstance(f, ScrubFilter) for f in handler.filters):
                handler.addFilter(ScrubFilter())
