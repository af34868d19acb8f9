"""Steering files and skills: read at submit from agents/<name>/, into the system prompt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator import Status
from orchestrator.agents import agents_root, load_docs
from orchestrator.validation import SpecError, check_spec, parse_spec_data
from tests.conftest import ROOT

STYLE = "Answer in exactly one line."
TRIAGE = "When findings compete, sort them by severity."


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory holds agents/reviewer/ (and the worker's does not)."""
    (tmp_path / "agents/reviewer/steering").mkdir(parents=True)
    (tmp_path / "agents/reviewer/skills").mkdir()
    (tmp_path / "agents/reviewer/steering/style.md").write_text(f"{STYLE}\n")
    (tmp_path / "agents/reviewer/skills/triage.md").write_text(f"{TRIAGE}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def system_prompt(model_server, model: str) -> str:
    first = model_server.calls(model)[0]["messages"][0]
    assert first["role"] == "system"
    return first["content"]


def test_steering_and_skills_reach_the_models_system_prompt(project, client, worker, spec, model_server):
    s = spec(
        [{"content": "done"}],
        steering_files=["agents/reviewer/steering/style.md"],
        skills=["agents/reviewer/skills/triage.md"],
    )
    assert client.submit(s).wait(timeout=30).status == Status.completed
    prompt = system_prompt(model_server, s["model"])
    assert f"Always follow these instructions:\n{STYLE}" in prompt
    assert f"Skill (apply when relevant):\n{TRIAGE}" in prompt
    assert prompt.index(STYLE) < prompt.index(TRIAGE)
    # read at submit from the submitter's cwd: the worker runs in the repository, whose
    # example agent has a reviewer/steering/style.md of its own
    assert "Review style" in (ROOT / "agents/reviewer/steering/style.md").read_text()
    assert "Review style" not in prompt


def test_a_missing_file_is_skipped_with_a_warning(project, client, worker, spec, model_server, store):
    s = spec(
        [{"content": "done"}],
        steering_files=["agents/reviewer/steering/gone.md", "agents/reviewer/steering/style.md"],
    )
    report = check_spec(parse_spec_data(s), store)
    assert report.errors == []
    assert report.warnings == ["steering_files.0: 'agents/reviewer/steering/gone.md' not found; skipped"]
    assert client.submit(s).wait(timeout=30).status == Status.completed
    prompt = system_prompt(model_server, s["model"])
    assert prompt.count("Always follow these instructions:") == 1 and STYLE in prompt


def test_a_path_outside_the_agent_folder_is_refused_at_submit(project, client, spec, store):
    (project / "secret.md").write_text("not for the model")
    before = store.list_runs(1000)
    with pytest.raises(SpecError) as refused:
        client.submit(spec([{"content": "x"}], steering_files=["secret.md"]))
    assert "steering_files.0: 'secret.md' resolves to" in str(refused.value)
    assert "outside the agents folder" in str(refused.value)
    assert store.list_runs(1000) == before  # nothing written


@pytest.mark.parametrize(
    "field,path,problem",
    [
        ("steering_files", "agents/reviewer/skills/triage.md", "not in an agent's steering folder"),
        ("skills", "agents/reviewer/steering/style.md", "not in an agent's skills folder"),
        ("steering_files", "agents/reviewer/style.md", "not in an agent's steering folder"),
        ("steering_files", "agents/reviewer/steering/../../../secret.md", "outside the agents folder"),
        ("steering_files", "/etc/hostname", "outside the agents folder"),
        ("steering_files", "agents/reviewer/steering/link.md", "outside the agents folder"),
        ("skills", "agents/reviewer/skills/notes.txt", "not a Markdown file"),
    ],
)
def test_placement_errors(project, field: str, path: str, problem: str):
    (project / "secret.md").write_text("x")
    (project / "agents/reviewer/steering/link.md").symlink_to(project / "secret.md")
    (project / "agents/reviewer/skills/notes.txt").write_text("x")
    docs = load_docs(**{"steering_files": [], "skills": [], field: [path]}, root=agents_root("agents"))
    assert len(docs.errors) == 1 and problem in docs.errors[0], docs.errors
    assert docs.errors[0].startswith(f"{field}.0: {path!r}")
    assert docs.steering == docs.skills == []


def test_paths_relative_to_the_agents_folder(project, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    os.chdir(elsewhere)  # the monkeypatch in `project` restores the cwd
    docs = load_docs(["reviewer/steering/style.md"], [str(project / "agents/reviewer/skills/triage.md")],
                     root=agents_root(project / "agents"))  # fmt: skip
    assert (docs.steering, docs.skills, docs.errors) == ([STYLE], [TRIAGE], [])


def test_an_empty_file_is_a_warning(project):
    (project / "agents/reviewer/skills/empty.md").write_text("  \n")
    docs = load_docs([], ["agents/reviewer/skills/empty.md"], root=agents_root("agents"))
    assert docs.errors == [] and docs.skills == []
    assert docs.warnings == ["skills.0: 'agents/reviewer/skills/empty.md' is empty; skipped"]


def test_the_agents_dir_setting(project, store):
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore

    moved = project / "agents"
    os.chdir(project.parent)  # ./agents does not exist here
    spec = parse_spec_data({"prompt": "p", "model": "m", "skills": ["reviewer/skills/triage.md"]})
    default = check_spec(spec, store)  # ./agents/reviewer/skills/triage.md: not here
    assert default.skill_docs == [] and "not found" in default.warnings[0]
    custom = RunStore(store.redis, Settings(key_prefix=store.settings.key_prefix, agents_dir=str(moved)))
    report = check_spec(spec, custom)
    assert (report.errors, report.skill_docs) == ([], [TRIAGE])
