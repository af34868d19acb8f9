"""Steering files and skills: Markdown read at submit from a per-agent folder.

An agent is a folder ``agents/<name>/`` with two subfolders::

    agents/reviewer/steering/style.md    always-on instructions (spec: steering_files)
    agents/reviewer/skills/triage.md     "apply when relevant"  (spec: skills)

A spec names its files by path, and the agent is the ``agents/<name>`` folder
each path sits in::

    steering_files: [agents/reviewer/steering/style.md]
    skills: [agents/reviewer/skills/triage.md]

The agents folder is ``./agents`` (relative to the current directory at submit)
or ``TOOLOOP_AGENTS_DIR``. A relative path is read from the current directory
first, as you would type it in a shell; when no such file exists there and it
is not inside the agents folder, it is read relative to the agents folder itself (``reviewer/steering/
style.md``), so specs keep working when ``TOOLOOP_AGENTS_DIR`` points elsewhere.

Checks: a path that resolves (symlinks included) outside
``<agents>/<name>/steering/`` (for steering_files) or ``<agents>/<name>/skills/``
(for skills), or that is not ``.md``, is an error; a missing or empty file is a
warning and is skipped. The text is read once, at submit, and stored with the
run's first messages: workers never read these files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# spec field -> the subfolder of an agent its files must live in
KINDS = {"steering_files": "steering", "skills": "skills"}


@dataclass
class AgentDocs:
    """What the spec's files yield: texts in spec order, plus problems found."""

    steering: list[str] = field(default_factory=list)
    skills: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def agents_root(agents_dir: str | Path) -> Path:
    """The agents folder, resolved now (a relative setting follows the current directory)."""
    return Path(agents_dir).expanduser().resolve()


def load_docs(steering_files: list[str], skills: list[str], root: Path) -> AgentDocs:
    docs = AgentDocs()
    for spec_field, paths in (("steering_files", steering_files), ("skills", skills)):
        texts = docs.steering if spec_field == "steering_files" else docs.skills
        for index, raw in enumerate(paths):
            text = _load_one(f"{spec_field}.{index}", raw, KINDS[spec_field], root, docs)
            if text is not None:
                texts.append(text)
    return docs


def _load_one(where: str, raw: str, kind: str, root: Path, docs: AgentDocs) -> str | None:
    path = resolve(raw, root)
    problem = placement_problem(path, kind, root)
    if problem:
        docs.errors.append(f"{where}: {raw!r} {problem}")
        return None
    if not path.is_file():
        docs.warnings.append(f"{where}: {raw!r} not found; skipped")
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        docs.errors.append(f"{where}: {raw!r} cannot be read: {exc}")
        return None
    if not text:
        docs.warnings.append(f"{where}: {raw!r} is empty; skipped")
        return None
    return text


def resolve(raw: str, root: Path) -> Path:
    """The file a spec path names: as typed from the current directory, else
    relative to the agents folder (see the module docstring)."""
    typed = Path(raw).expanduser()
    first = typed.resolve()
    if typed.is_absolute() or first.is_relative_to(root) or first.exists():
        return first
    return (root / typed).resolve()


def placement_problem(path: Path, kind: str, root: Path) -> str | None:
    """Why ``path`` may not be used as a ``kind`` file, or None if it may."""
    expected = f"{root}/<agent>/{kind}/"
    if not path.is_relative_to(root):
        return f"resolves to {path}, outside the agents folder: it must be in {expected}"
    parts = path.relative_to(root).parts
    if len(parts) < 3 or parts[1] != kind:
        return f"is not in an agent's {kind} folder: it must be in {expected}"
    if path.suffix != ".md":
        return "is not a Markdown file (.md)"
    return None
