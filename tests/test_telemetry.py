"""Traces across processes, over real OTLP: one run is one trace, whatever worker ran each step."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from orchestrator import telemetry
from tests.conftest import ROOT
from tests.helpers import call, tools, wait_for

otlp = pytest.importorskip("tests.otlp", reason="the otel extra is not installed (pip install -e '.[otel]')")


@pytest.fixture
def producer_spans() -> Iterator:
    """This process (the producer) traces into memory."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    telemetry.install(telemetry.make_provider(exporter, batch=False))
    yield exporter
    telemetry.uninstall()


def _env(receiver, protocol: str, service: str, **extra: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_SERVICE_NAME": service, "OTEL_BSP_SCHEDULE_DELAY": "100", **extra}  # fmt: skip


def _at_least(receiver, trace_id: int, count: int) -> list:
    """The trace's spans once ``count`` have arrived, and the run's span among them."""

    def arrived() -> list:
        spans = receiver.of_trace(trace_id)
        return spans if len(spans) >= count and any(s.name == "tooloop.run" for s in spans) else []

    return wait_for(arrived, timeout=30)


def _by_name(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_one_run_is_one_trace_across_turn_and_tool_workers(deployment, spec, producer_spans) -> None:
    receiver = otlp.HttpReceiver()
    try:
        d = deployment()
        d.start_worker("-Q", "turns", env=_env(receiver, "http/protobuf", "tooloop-turns"), roles=("turns",))
        d.start_worker("-Q", "tools", env=_env(receiver, "http/protobuf", "tooloop-tools"), roles=("tools",))
        first = tools(call("add", {"a": 2, "b": 3}), call("boom", {"message": "no"}))
        steps = [first, {"content": "5", "tokens": 7}]
        handle = d.client.submit(spec(steps, tools=["add", "boom"], prompt="secret plan: add 2 and 3"))
        assert handle.wait(timeout=60).content == "5"
        trace_id, run_span_id = telemetry.run_ids(d.prefix, handle.run_id)

        def complete() -> list:
            spans = receiver.of_trace(trace_id)
            names = [s.name for s in spans]
            # every span this run makes, each exported by its own process's batch: the run's
            # span (ended by turn 2) can reach the receiver before turn 2's own
            counts = [names.count(f"tooloop.{name}") for name in ("run", "turn", "tool_call")]
            return spans if counts == [1, 2, 2] else []

        spans = _by_name(wait_for(complete, timeout=30))
        run, = spans["tooloop.run"]
        turns = sorted(spans["tooloop.turn"], key=lambda s: s.attributes["tooloop.iteration"])
        models = spans["tooloop.model_call"]
        calls = spans["tooloop.tool_call"]
        # the shape: run > turn > model call / tool call
        assert (run.span_id, run.parent_id) == (run_span_id, 0)
        assert [t.attributes["tooloop.iteration"] for t in turns] == [1, 2]
        assert all(t.parent_id == run.span_id for t in turns)
        assert len(models) == 2 and {m.parent_id for m in models} == {t.span_id for t in turns}
        assert {c.parent_id for c in calls} == {turns[0].span_id}
        # across two worker processes, each its own service
        assert {t.service for t in turns} | {m.service for m in models} == {"tooloop-turns"}
        assert {c.service for c in calls} == {"tooloop-tools"}
        # attributes: run id, iteration, tool, tokens, exit, error type
        assert run.attributes["tooloop.run_id"] == handle.run_id
        assert (run.attributes["tooloop.exit"], run.attributes["tooloop.status"]) == ("default", "completed")
        assert run.attributes["tooloop.iterations"] == 2
        # the run spans from its creation to the moment its end was recorded, inside the last turn
        assert run.start_ns <= turns[0].start_ns and turns[1].start_ns <= run.end_ns <= turns[1].end_ns
        by_tool = {c.attributes["tooloop.tool"]: c for c in calls}
        assert by_tool["add"].attributes["tooloop.success"] is True and by_tool["add"].status_code != 2
        assert by_tool["boom"].attributes["error.type"] == "RuntimeError" and by_tool["boom"].status_code == 2
        assert turns[1].attributes["tooloop.exit"] == "default"
        last = next(m for m in models if m.parent_id == turns[1].span_id)
        assert last.attributes["gen_ai.usage.total_tokens"] == 7
        # no text of the run in any span unless asked
        assert "secret plan" not in repr([s.attributes for s in receiver.of_trace(trace_id)])
        assert not any("tooloop.input" in s.attributes for s in models)
    finally:
        receiver.stop()
    # the producer's submit span sits in the same trace, under the run's span
    submitted = [s for s in producer_spans.get_finished_spans() if s.name == "tooloop.submit"]
    assert [(s.context.trace_id, s.parent.span_id) for s in submitted] == [(trace_id, run_span_id)]


def test_grpc_export_and_content_when_asked_scrubbed(deployment, spec) -> None:
    receiver = otlp.GrpcReceiver()
    try:
        d = deployment()
        d.start_worker(env=_env(receiver, "grpc", "tooloop", TOOLOOP_TRACE_CONTENT="true"))
        prompt = "use key sk-live1234567890abcdef and password=hunter2 to add"
        handle = d.client.submit(spec([{"content": "token=abc123secret done"}], prompt=prompt))
        assert handle.wait(timeout=60).status == "completed"
        trace_id, _ = telemetry.run_ids(d.prefix, handle.run_id)
        spans = _by_name(_at_least(receiver, trace_id, 3))
        model, = spans["tooloop.model_call"]
        assert "add" in model.attributes["tooloop.input"]
        assert "sk-live" not in model.attributes["tooloop.input"]
        assert "hunter2" not in model.attributes["tooloop.input"]
        assert "[REDACTED]" in model.attributes["tooloop.input"]
        assert "abc123secret" not in model.attributes["tooloop.output"]
        output = model.attributes["tooloop.output"]
        assert output.startswith("token=") and "REDACTED" in output
        assert {s.name for s in receiver.of_trace(trace_id)} >= {"tooloop.run", "tooloop.turn"}
    finally:
        receiver.stop()


def test_a_model_error_marks_the_spans(deployment, spec) -> None:
    receiver = otlp.HttpReceiver()
    try:
        d = deployment()
        d.start_worker("-Q", "turns", env=_env(receiver, "http/protobuf", "t"), roles=("turns",))
        nowhere = {"api_base": "http://127.0.0.1:9/v1", "api_key": "sk-own"}  # a literal key may go anywhere
        s = spec([{"content": "never"}], model_params=nowhere)
        handle = d.client.submit(s)
        result = handle.wait(timeout=60)
        assert result.exit == "error"
        trace_id, _ = telemetry.run_ids(d.prefix, handle.run_id)
        spans = _by_name(_at_least(receiver, trace_id, 3))
        model, = spans["tooloop.model_call"]
        run, = spans["tooloop.run"]
        assert model.status_code == 2 and model.attributes["error.type"] == result.error_type
        assert run.status_code == 2 and run.attributes["error.type"] == result.error_type
    finally:
        receiver.stop()


def test_the_producer_exports_its_submit_span_from_the_standard_variables() -> None:
    """A producer script with only the OTEL_* variables set sends its span over OTLP before it
    exits, in the run's trace, under the run's span (no provider installed by hand)."""
    receiver = otlp.HttpReceiver()
    prefix = f"{os.environ['TOOLOOP_KEY_PREFIX']}-producer"
    probe = ("from orchestrator import Client\n"
             "print(Client().submit({'prompt': 'x', 'model': 'openai/x'}).run_id)")  # fmt: skip
    env = {**os.environ, **_env(receiver, "http/protobuf", "a-producer"), "TOOLOOP_KEY_PREFIX": prefix}
    try:
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        trace_id, run_span_id = telemetry.run_ids(prefix, out.stdout.strip())
        spans = receiver.of_trace(trace_id)  # flushed at exit: no waiting
        shape = [(s.name, s.parent_id, s.service) for s in spans]
        assert shape == [("tooloop.submit", run_span_id, "a-producer")]
    finally:
        receiver.stop()


def test_without_an_exporter_tracing_imports_nothing() -> None:
    """Unconfigured, submitting a run loads no tracing SDK, exporter or Prometheus client
    (redis-py 8 itself imports opentelemetry.sdk.metrics: not ours to avoid)."""
    probe = ("import sys, os\n"
             "os.environ.pop('OTEL_EXPORTER_OTLP_ENDPOINT', None)\n"
             "from orchestrator import Client, telemetry\n"
             "from orchestrator.logs import bind\n"
             "bind('p', 'run-1', 1)\n"
             "client = Client()\n"
             "client.submit({'prompt': 'x', 'model': 'openai/x'})\n"
             "assert not telemetry.enabled() and telemetry.tracer() is None\n"
             "heavy = ('opentelemetry.sdk.trace', 'opentelemetry.exporter', 'prometheus_client', 'grpc')\n"
             "print(sorted(m for m in heavy if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_run_ids_are_stable_and_distinct() -> None:
    a = telemetry.run_ids("tooloop", "run-1")
    assert a == telemetry.run_ids("tooloop", "run-1")
    assert a != telemetry.run_ids("other", "run-1") and a != telemetry.run_ids("tooloop", "run-2")
    assert 0 < a[0] < 2**128 and 0 < a[1] < 2**64
    assert telemetry.trace_id_hex("tooloop", "run-1") == f"{a[0]:032x}"


def test_span_text_is_scrubbed_and_capped() -> None:
    text = "Authorization: Bearer abcdefghijklmnop, AKIAABCDEFGHIJKLMNOP, redis://:s3cretpw@host "
    text += "x" * 9000
    out = telemetry.scrub(text)
    assert "abcdefghijklmnop" not in out and "AKIAABCDEFGHIJKLMNOP" not in out and "s3cretpw" not in out
    assert "REDACTED" in out and len(out) == telemetry.CONTENT_CHARS
    assert telemetry.scrub("plain words stay") == "plain words stay"


WITHOUT_SDK = ("import sys\n"
               "for name in ('opentelemetry.sdk', 'opentelemetry.exporter'):\n"
               "    sys.modules[name] = None  # import fails as without the otel extra\n"
               "from orchestrator.cli import main\n"
               "sys.argv = ['tooloop', *sys.argv[1:]]\n"
               "main()\n")  # fmt: skip


def test_otlp_configured_without_the_sdk_says_what_to_install_and_runs_untraced(tmp_path, client, worker,
                                                                                spec) -> None:  # fmt: skip
    """Failed before: `tooloop submit` died with a ModuleNotFoundError traceback."""
    import json

    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec([{"content": "untraced"}])))
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_SDK, "submit", str(path), "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    [said] = done.stderr.splitlines()  # one line: what is missing and what to install
    assert "OpenTelemetry is not installed" in said and "pip install 'tooloop[otel]'" in said, said
    assert client.get(json.loads(done.stdout)["run_id"]).wait(timeout=60).content == "untraced"
