"""Schemathesis against the running operator API: generated requests (valid and invalid) with
a tenant's token and a real run id; no status code the OpenAPI document does not list, no
server error, and replies that match their documented schema and content type."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.local import free_port
from tests.conftest import ROOT
from tests.helpers import READY_S, wait_for

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture
def api_process(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "api.log").open("w")
    command = [sys.executable, "-m", "orchestrator.cli", "api", "--port", str(port), "-l", "warning"]
    proc = subprocess.Popen(command,
                            env={**os.environ, "TOOLOOP_API_TOKENS": "st-token=acme"}, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/api/health", timeout=5).status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, (tmp_path / "api.log").read_text()
            return False

    wait_for(up, timeout=READY_S, interval=0.2)
    yield base
    proc.terminate()
    proc.wait(20)
    assert "Traceback" not in (tmp_path / "api.log").read_text(), (tmp_path / "api.log").read_text()[-4000:]


def test_schemathesis_finds_no_undocumented_status_and_no_server_error(api_process, client, worker, spec,
                                                                        tmp_path) -> None:  # fmt: skip
    binary = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    assert binary, "schemathesis is part of the test extra: pip install -e '.[test]'"
    run = client.submit(spec([{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
                              {"content": "3"}], tools=["add"], tenant="acme"))  # fmt: skip
    assert run.wait(timeout=60).status == "completed"
    command = [binary, "--config-file", str(ROOT / "tests" / "schemathesis.toml"), "run",
               f"{api_process}/openapi.json", "--checks", CHECKS, "--max-examples", "30",
               "--phases", "examples,coverage,fuzzing", "--seed", "1", "--no-color",
               "--report", "junit", "--report-dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "TOOLOOP_ST_TOKEN": "st-token", "TOOLOOP_ST_RUN_ID": run.run_id}
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", report)
    assert generated and int(generated[1]) >= 100 and generated[1] == generated[2], report[-3000:]
