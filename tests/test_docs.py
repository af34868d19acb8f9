"""The docs ship with the code: every relative link in README.md and docs/ resolves in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "agents" / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    targets = [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"


def test_the_readme_links_the_reference() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/reference.md)" in readme
    assert "shared/" not in readme and "CONTRACT" not in readme
