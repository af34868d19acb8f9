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

    A long text is scrubbed in pieces of about ``PIECE_CHARS``, each cut where no secret
    runs across (``cut``) and scrubbed together with the end of the previous one
    (``continued``): one regex pass holds the GIL throughout, and a 5 MB output in one
    pass starved the tool worker's heartbeat thread for seconds (its call was declared
    lost). The pieces give what one pass would.
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
    """``text`` in pieces of about PIECE_CHARS, each ending where no secret runs across."""
    pieces, start = [], 0
    while start < len(text):
        end = len(text) if len(text) - start <= PIECE_CHARS else cut(text, start, start + PIECE_CHARS)
        pieces.append(text[start:end])
        start = end
    return pieces


CUT_WINDOW = 4096  # how far back from a piece's natural end a cut is looked for
CHECK_CHARS = 8192  # how much before a cut is scrubbed to see whether a masked match runs to it
TOKEN_START_CHARS = 256  # a token's first characters this close to a cut: cut before them
_BREAK = re.compile(r"""[\s"']""")  # no pattern runs across these (a pair's key and value:
# ``continued`` joins them again)
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_.-]")  # no token shape holds these
_STOP_CHAR = re.compile(rf"[{_STOP}]")  # every credential value ends before one of these
_TOKEN_START = re.compile(r"sk-|gh[pousr]_|github_pat_|AKIA|ASIA|xox|eyJ")
# the first characters of a token shape, up to the end of the text
_TOKEN_HEADS = re.compile(r"(?:s|sk|g|gh|gh[pousr]|github|github_(?:p|pa|pat)?|A|AK|AKI|AS|ASI|x|xo|e|ey)\Z")
CANDIDATES = 4  # cuts after a character no token holds, tried before a run of token characters


def cut(text: str, start: int, end: int) -> int:
    """Where the piece ``text[start:]`` should end, near ``end``, so that no secret runs
    across two pieces (a secret cut in two was masked in neither: issue 22 item 7):

    1. just after the last whitespace or quote of the last ``CUT_WINDOW`` characters;
    2. else just after one of the last characters no token shape holds (``+``, ``/``,
       ``,``...), where no masked match ends (a credential's value may hold ``+`` or ``/``);
    3. else, in a run of token characters: past the run when a masked match runs into it
       (the piece is longer), or before a token's first characters close to the cut.

    ``len(text)`` when the run goes on to the end of ``text``. ``end`` may be ``len(text)``
    (a live stream, which more text may continue).
    """
    low = max(start + 1, end - CUT_WINDOW)
    window = text[low:end]
    breaks = [m.end() for m in _BREAK.finditer(window)]
    if breaks:
        return low + breaks[-1]
    for found in [m.end() for m in _NOT_TOKEN.finditer(window)][-CANDIDATES:][::-1]:
        if not _masked_to(text, max(start, low + found - CHECK_CHARS), low + found):
            return low + found
    if _masked_to(text, start, end):  # a secret runs on (it began in this piece): take all of it
        after = _STOP_CHAR.search(text, end)
        return after.end() if after else len(text)
    # a token whose first characters lie close before the cut and run on to it (not masked:
    # still too short, or only begun): cut before it
    near = _TOKEN_START.finditer(text, max(start + 1, end - TOKEN_START_CHARS), end + 32)
    starts = [m.start() for m in near if m.start() < end and not _NOT_TOKEN.search(text, m.start(), end)]
    if end == len(text):  # a live stream: its end may be a token's first characters
        starts += [i for i in range(max(start + 1, end - 10), end) if _TOKEN_HEADS.match(text, i)][:1]
    return min(starts) if starts else end


def runs_on(text: str) -> bool:
    """Does a masked match run to the end of ``text`` (more text may continue it)?"""
    return _masked_to(text, max(0, len(text) - CHECK_CHARS), len(text))


def value_run(text: str) -> int:
    """How many of ``text``'s first characters may continue a credential's value or a token."""
    stop = _STOP_CHAR.search(text)
    return stop.start() if stop else len(text)


def _masked_to(text: str, start: int, at: int) -> bool:
    """Does a match masked in ``text[start:at]`` end right at ``at``? Then it may run on."""
    before = text[start:at]
    clean = _scrub(before)
    return clean != before and clean.endswith(SHORT_MASK)


def continued(context: str, piece: str) -> str:
    """``piece`` scrubbed as the continuation of ``context`` (the end of the text before it,
    already scrubbed): a ``password: ...`` pair straddling the two is still masked. Scrubbing
    is idempotent, so the context comes back unchanged and is cut off again."""
    whole = _scrub(context + piece)
    if whole.startswith(context):
        return whole[len(context) :]
    # A match began in the context and runs into the piece (a secret cut in two: ``cut``
    # avoids it, a live stream cannot always): what was sent stays, the rest is masked.
    same = next((i for i, (a, b) in enumerate(zip(whole, context, strict=False)) if a != b), len(context))
    return whole[same:]


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
