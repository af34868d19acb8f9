"""``tooloop``: thin commands over the client and the run store.

stdout carries results only (one JSON document with ``--json``); logs and
progress go to stderr. Exit codes: 0 success, 1 the run ended on a reserved
exit (or validation found errors), 2 bad usage or a spec refused.
Control and status commands import neither litellm nor the Celery worker.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from orchestrator.bounds import TooLong
from orchestrator.models import RunResult

ARGV = "tooloop.argv"  # ctx.meta: the command's own arguments, as typed


class CliError(Exception):
    """A command's refusal or failure: said once on stderr, and as stdout's one JSON
    document with --json. ``kind`` is that document's ``error.type``."""

    def __init__(self, message: str, code: int, kind: str) -> None:
        super().__init__(message)
        self.message, self.code, self.kind = message, code, kind


class Commands(TyperGroup):
    """Every command's errors in one place: with ``--json`` on the command line, stdout
    holds ``{"error": {"type", "message"}}`` whatever failed (typer's usage errors too)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta[ARGV] = list(args)  # what follows the group: the command and its arguments
        return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            error = _as_cli_error(exc)
            as_json = "--json" in ctx.meta.get(ARGV, [])
            if error is None:  # a defect: its traceback, and still one document with --json
                if not as_json:
                    raise
                traceback.print_exc()
                error = CliError(f"{type(exc).__name__}: {exc}", 1, "internal")
            _report(error, exc, as_json)
            raise typer.Exit(error.code) from None


def _as_cli_error(exc: Exception) -> CliError | None:
    """The CliError an exception means, or None for a defect."""
    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, TooLong):  # a steer text, a reason: refused, nothing written
        return CliError(str(exc), 2, "usage")
    if _usage_error(exc):
        return CliError(exc.format_message(), getattr(exc, "exit_code", 2), "usage")
    if _bad_setting(exc):  # a TOOLOOP_* variable that does not parse: refused at start, named
        return CliError("; ".join(_setting_errors(exc)), 2, "usage")
    errors = sys.modules.get("redis.exceptions")  # (loaded by the commands that use Redis: not --help)
    if errors is not None and isinstance(exc, errors.ConnectionError):
        return CliError(f"Redis unreachable at TOOLOOP_REDIS_URL: {exc}", 1, "redis_unreachable")
    return None


def _bad_setting(exc: Exception) -> bool:
    from pydantic import ValidationError

    return isinstance(exc, ValidationError) and exc.title == "Settings"


def _setting_errors(exc: Any) -> list[str]:
    """Each bad setting as one line naming its variable (a check of its own names it already)."""
    out = []
    for error in exc.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        name = "TOOLOOP_" + "_".join(str(part) for part in error["loc"]).upper()
        out.append(message if message.startswith("TOOLOOP_") else f"{name}: {message}")
    return out


def _usage_error(exc: Exception) -> bool:
    """typer's own (0.2x vendors click) or click's, for a typer that still uses click."""
    click = sys.modules.get("click")
    return isinstance(exc, typer.TyperException) or (
        click is not None and isinstance(exc, click.ClickException))


def _report(error: CliError, exc: Exception, as_json: bool) -> None:
    if error.kind == "usage" and hasattr(exc, "show"):
        exc.show(file=sys.stderr)  # usage line, hint and message, as typer prints them
    elif error.kind == "redis_unreachable":
        _err(f"error: {error.message}")
    else:
        _err(error.message)
    if as_json:
        _print_json({"error": {"type": error.kind, "message": error.message}})


app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="tooloop: durable, distributed, bounded LLM tool-calling loops on Celery + Redis.",
)

RunArg = Annotated[str, typer.Argument(help="run id")]
JsonOpt = Annotated[bool, typer.Option("--json", help="one JSON document on stdout (errors too)")]


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def _fail(message: str, code: int, kind: str) -> NoReturn:
    raise CliError(message, code, kind)


def _client() -> Any:
    from orchestrator.client import Client

    return Client()


def _handle(run_id: str) -> Any:
    try:
        return _client().get(run_id)
    except KeyError:
        _fail(f"no run {run_id!r}", 2, "not_found")


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")


def _summary(result: RunResult, tree: list[Any] | None = None) -> str:
    """``tree``: the run's child runs, depth first (orchestrator.children.tree)."""
    lines = [
        f"run        {result.run_id}",
        f"status     {result.status.value}" + (f" ({result.exit})" if result.exit else ""),
        f"iterations {result.iterations}   tokens {result.tokens_used}   "
        f"tool calls {len(result.tool_calls)}",
    ]
    if result.error:
        lines.append(f"error      {result.error_type}: {result.error}")
    if result.content:
        lines.append(f"content    {result.content}")
    if result.parent:
        lines.append(f"parent     {result.parent.run_id} (call {result.parent.call_id})")
    for node in tree or []:
        ended = f" ({node.exit})" if node.exit else ""
        lines.append(f"{'child' if node.depth == 1 else '':<10} {'  ' * (node.depth - 1)}{node.run_id}  "
                     f"{node.agent}  {node.status}{ended}  tokens {node.tokens_used}")  # fmt: skip
    return "\n".join(lines)


def _exit_code(result: RunResult) -> int:
    return 0 if result.succeeded else 1


# -- runs ---------------------------------------------------------------------
@app.command()
def submit(
    spec: Annotated[Path, typer.Argument(help="run spec, YAML or JSON")],
    prompt: Annotated[str | None, typer.Option(help="replaces the spec's prompt")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="wait for the result")] = False,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait with --wait")] = 600,
) -> None:
    """Submit a run; print its id (or its result with --wait)."""
    from orchestrator.client import load_spec
    from orchestrator.validation import SpecError

    if not timeout > 0:  # (nan too) refused before the run exists, not reported as "still running" after
        raise typer.BadParameter(f"{timeout:g}: seconds to wait must be > 0", param_hint="'--timeout'")
    try:
        handle = _client().submit(load_spec(spec, prompt))
    except SpecError as exc:
        _fail(str(exc), 2, "spec_refused")
    for warning in handle.warnings:
        _err(f"warning: {warning}")
    if not wait:
        if as_json:
            _print_json({"run_id": handle.run_id, "status": handle.status().value})
        else:
            print(handle.run_id)
        return
    _err(f"run {handle.run_id} submitted; waiting")
    try:
        result = handle.wait(timeout=timeout)
    except TimeoutError as exc:
        _err(str(exc))
        result = handle.result()
        _print_json(result.model_dump(mode="json")) if as_json else print(_summary(result))
        raise typer.Exit(1) from exc
    _print_json(result.model_dump(mode="json")) if as_json else print(_summary(result))
    raise typer.Exit(_exit_code(result))


@app.command()
def status(run_id: RunArg, as_json: JsonOpt = False) -> None:
    """State of one run."""
    from orchestrator.children import tree

    handle = _handle(run_id)
    result = handle.result()
    if as_json:
        _print_json(result.model_dump(mode="json"))
        return
    print(_summary(result, tree(handle.client.store, run_id) if result.children else None))
    waiting = int(handle.client.store.state(run_id).get("children_waiting") or 0)
    if waiting > 0 and not result.status.ended:
        print(f"waiting    for {waiting} child run(s)")


@app.command("list")
def list_runs(
    limit: Annotated[int, typer.Option(help="how many")] = 20,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's runs")] = None,
    pending: Annotated[bool, typer.Option("--pending", help="only runs waiting for an approval")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Recent runs, newest first."""
    from orchestrator.views import RunSummary, runs_table

    if pending:
        from orchestrator.approvals import waiting_runs

        rows = waiting_runs(_client().store, tenant=tenant)[:limit]
    else:
        rows = _client().list(limit, tenant)
    runs = [RunSummary.from_row(row) for row in rows]
    if as_json:
        _print_json([run.model_dump(mode="json") for run in runs])
        return
    runs_table(runs)


@app.command()
def watch(run_id: RunArg) -> None:
    """Live progress until the run ends (a finished run is replayed)."""
    from orchestrator.views import watch_run

    handle = _handle(run_id)
    try:
        result = watch_run(handle)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None  # the run goes on; only watching stops
    except BrokenPipeError:  # `tooloop watch RUN | head`: the reader left
        sys.stderr.close()
        raise typer.Exit(0) from None
    raise typer.Exit(_exit_code(result) if result else 1)


@app.command()
def validate(spec: Annotated[Path, typer.Argument(help="run spec, YAML or JSON")]) -> None:
    """Static checks of a spec; errors exit 1."""
    from orchestrator.client import load_spec
    from orchestrator.store import RunStore
    from orchestrator.validation import SpecError, check_spec

    try:
        loaded = load_spec(spec)
    except SpecError as exc:
        _fail(str(exc), 1, "spec_refused")
    try:
        store = RunStore.from_settings()
        store.redis.ping()
    except Exception as exc:  # offline validation still checks everything else
        _err(f"warning: Redis unreachable ({exc}); tool names not checked")
        store = None
    report = check_spec(loaded, store)
    for warning in report.warnings:
        _err(f"warning: {warning}")
    for error in report.errors:
        _err(f"error: {error}")
    if report.errors:
        raise typer.Exit(1)
    print(f"{spec}: ok")


@app.command("tools")
def tools_command(as_json: JsonOpt = False) -> None:
    """The live tool catalog: each tool's source (python, builtin, mcp, http) and workers."""
    from orchestrator.catalog import live_tools, tools_rows, unavailable_servers
    from orchestrator.store import RunStore
    from orchestrator.views import plain_table

    store = RunStore.from_settings()
    entries = live_tools(store)
    for down in unavailable_servers(store):  # stderr: stdout stays the catalog (or its JSON)
        _err(f"warning: MCP server {down['server']!r} on {down['worker']} is unavailable, its tools are "
             f"not listed: {down['error']}")  # fmt: skip
    if as_json:
        _print_json(entries)
        return
    if not entries:
        _fail("no live tool worker has published its tools", 1, "no_tools")
    print(plain_table(tools_rows(entries)))
    print("(http tools are declared per run, in specs: `http_tools`)", file=sys.stderr)


@app.command()
def fork(
    run_id: RunArg,
    at: Annotated[int, typer.Option("--at", help="the turn the fork starts at (1..turns+1)")],
    prompt_append: Annotated[str | None, typer.Option(
        "--prompt-append", help="an instruction that ends the fork's history (a user message)")] = None,
    model: Annotated[str | None, typer.Option("--model", help="the model the fork runs on")] = None,
    as_json: JsonOpt = False,
) -> None:
    """A new run with RUN's history as it stood when turn N began; nothing before N runs again."""
    from orchestrator.fork import ForkError

    try:
        handle = _client().fork(run_id, at, prompt_append, model, by=_who())
    except ForkError as exc:
        _fail(str(exc), 2, exc.kind)
    if as_json:
        _print_json({"run_id": handle.run_id, "status": handle.status().value,
                     "forked_from": {"run_id": run_id, "iteration": at}})  # fmt: skip
    else:
        print(handle.run_id)


@app.command("record")
def record_command(
    run_id: RunArg,
    output: Annotated[str, typer.Option("-o", "--output", help="the cassette file to write ('-': stdout)")],
    as_json: JsonOpt = False,
) -> None:
    """Write an ended run's cassette (JSON lines): replay it offline with `tooloop replay`."""
    from orchestrator.replay.cassette import dumps
    from orchestrator.replay.record import RecordError, record

    try:
        cassette = record(_client().store, run_id)
    except RecordError as exc:
        _fail(str(exc), 2, exc.kind)
    text = dumps(cassette)
    if output == "-":
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(f"{output}: {exc}", 2, "usage")
    summary = {"path": output, "run_id": run_id, "turns": len(cassette.turns), "calls": len(cassette.calls)}
    if as_json:
        _print_json(summary)
    else:
        print(output)
        _err(f"recorded run {run_id}: {summary['turns']} turn(s), {summary['calls']} call(s)")


@app.command("replay")
def replay_command(
    cassette: Annotated[Path, typer.Argument(help="a cassette written by `tooloop record`")],
    tools: Annotated[str, typer.Option("--tools", help="recorded: results from the cassette; live: run "
                                       "the tools (in a sandbox folder of the replay's own)")] = "recorded",
    keep_going: Annotated[bool, typer.Option("--continue", help="go on past the first divergence")] = False,
    spec: Annotated[Path | None, typer.Option(
        "--spec", help="run this spec instead of the recorded one (its endpoint and keys: the replay's own)",
    )] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a recorded run's loop again, offline: exit 0 when it does the same, 1 where it parts."""
    from orchestrator.client import load_spec
    from orchestrator.testing import ReplayError, replay
    from orchestrator.validation import SpecError

    if tools not in ("recorded", "live"):
        raise typer.BadParameter(f"{tools!r}: recorded or live", param_hint="'--tools'")
    try:
        given = load_spec(spec) if spec is not None else None
        report = replay(cassette, tools=tools, keep_going=keep_going, spec=given)
    except (ReplayError, SpecError) as exc:
        _fail(str(exc), 2, "cassette_refused")
    if as_json:
        _print_json(report.model_dump(mode="json"))
    else:
        print(_replay_summary(report))
    raise typer.Exit(0 if report.same else 1)


def _replay_summary(report: Any) -> str:
    turns = report.result.iterations if report.result else 0
    if report.same:
        return f"same: {report.cassette} replayed ({turns} turn(s), tools {report.tools})"
    lines = [f"diverged: {report.cassette} ({len(report.divergences)} divergence(s), tools {report.tools})"]
    for d in report.divergences:
        lines += [f"  {d.describe()}", f"    recorded: {json.dumps(d.recorded)}",
                  f"    now:      {json.dumps(d.now)}"]
    return "\n".join(lines)


# -- control --------------------------------------------------------------------
def _control(verdict: str, run_id: str, action: str) -> None:
    if verdict == "missing":
        _fail(f"no run {run_id!r}", 2, "not_found")
    if verdict == "ended":
        _fail(f"run {run_id} has already ended", 1, "ended")
    if verdict == "full":
        _fail(f"run {run_id} has too many steer messages waiting; try after its next turn", 1, "full")
    print(f"{action}: {run_id} ({verdict})")


@app.command()
def pause(run_id: RunArg) -> None:
    """Park a run in Redis; nothing starts until resume."""
    from orchestrator import control

    _control(control.pause(_client().store, run_id, by=_who()), run_id, "pause")


@app.command()
def resume(run_id: RunArg) -> None:
    """Resume a paused run."""
    _control(_client().resume(run_id, by=_who()), run_id, "resume")


@app.command()
def steer(run_id: RunArg, text: Annotated[str, typer.Argument(help="guidance")]) -> None:
    """Queue guidance for the run's next turn."""
    if not text.strip():
        _fail("steer text must not be empty", 2, "usage")
    _control(_client().store.steer(run_id, text, by=_who()), run_id, "steer")


@app.command()
def abort(
    run_id: RunArg,
    reason: Annotated[str, typer.Option(help="recorded in the run's error")] = "abort requested",
) -> None:
    """End a run now: status and exit `aborted`."""
    from orchestrator import control

    _control(control.abort(_client().store, run_id, by=_who(), reason=reason), run_id, "abort")


CallArg = Annotated[str, typer.Argument(help="the model's tool call id (shown by `tooloop watch`)")]


def _decided(verdict: str, run_id: str, call_id: str, action: str) -> None:
    if verdict == "missing":
        _fail(f"no run {run_id!r}", 2, "not_found")
    if verdict == "unknown":
        _fail(f"run {run_id} has no call {call_id!r} waiting for approval", 2, "not_found")
    if verdict == "ended":
        _fail(f"run {run_id} has already ended", 1, "ended")
    if verdict == "already":
        _fail(f"call {call_id} of run {run_id} was already decided; this {action} changed nothing", 1,
              "already")
    print(f"{action}: {run_id} {call_id} (ok)")


@app.command()
def approve(run_id: RunArg, call_id: CallArg) -> None:
    """Let a call waiting for approval run."""
    _decided(_client().decide(run_id, call_id, True, by=_who()), run_id, call_id, "approve")


@app.command()
def deny(
    run_id: RunArg,
    call_id: CallArg,
    reason: Annotated[str, typer.Option(help="told to the model")] = "denied by a person",
) -> None:
    """Refuse a call waiting for approval: the model gets a failed record with the reason."""
    _decided(_client().decide(run_id, call_id, False, reason, by=_who()), run_id, call_id, "deny")


def _who() -> str:
    return f"cli:{os.environ.get('USER', 'unknown')}@{socket.gethostname()}"


# -- processes --------------------------------------------------------------------
@app.command()
def worker(
    tools: Annotated[str | None, typer.Option("--tools", help="modules that register tools")] = None,
    queues: Annotated[str, typer.Option("-Q", "--queues", help="turns, tools or both")] = "turns,tools",
    concurrency: Annotated[int | None, typer.Option("-c", "--concurrency", help="slots per pool")] = None,
    name: Annotated[str | None, typer.Option("-n", "--name", help="node name")] = None,
    loglevel: Annotated[str, typer.Option("-l", "--loglevel")] = "info",
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="serve Prometheus metrics of all pool processes (and /healthz) on this port",
    )] = None,
) -> None:
    """A Celery worker for turns and/or tools."""
    from orchestrator.settings import get_settings

    get_settings()  # a bad TOOLOOP_* setting is refused here, as by every command
    argv = ["-Q", queues, "-l", loglevel]
    given = {"--tools": tools, "-c": concurrency, "-n": name, "--metrics-port": metrics_port}
    for flag, value in given.items():
        argv += [flag, str(value)] if value is not None else []
    # The data plane's own program from here on (worker/launcher.py), in this process: same pid,
    # same signals, its exit code ours. The CLI itself never imports worker code.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "worker.launcher", *argv])


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def flower(ctx: typer.Context) -> None:
    """Flower on this app; arguments pass through (--port=5555, --basic-auth=user:password)."""
    authenticated = any(os.environ.get(v) for v in ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")) or any(
        a.startswith(("--basic-auth", "--basic_auth", "--auth")) for a in ctx.args)
    if not authenticated:  # fine on a laptop; anywhere else Flower shows every task's arguments
        _err("warning: Flower runs without authentication: set FLOWER_BASIC_AUTH=user:password")
    os.environ.setdefault("FLOWER_UNAUTHENTICATED_API", "true")  # used only when no auth is set
    argv = [sys.executable, "-m", "celery", "-A", "worker.app", "flower", *ctx.args]
    os.execv(sys.executable, argv)


@app.command()
def demo(runs: Annotated[int, typer.Option(help="how many runs to submit")] = 3) -> None:
    """The whole system on one machine, no setup (embedded Redis, local worker)."""
    from orchestrator.demo import run_demo

    raise typer.Exit(run_demo(runs))


@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """Which sandbox layers, Redis, queues and workers are live."""
    from orchestrator.doctor import diagnose, render

    report = diagnose()
    _print_json(report) if as_json else render(report)
    raise typer.Exit(0 if report["redis"]["ok"] else 1)


@app.command()
def api(
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    loglevel: Annotated[str, typer.Option("-l", "--loglevel")] = "info",
    insecure_local: Annotated[bool, typer.Option(
        "--insecure-local",
        help="without TOOLOOP_API_TOKENS: the console signs in as tenant default (loopback only)",
    )] = False,
) -> None:
    """The operator HTTP API and the run console at / (tokens from TOOLOOP_API_TOKENS); OpenAPI at /docs."""
    from orchestrator.settings import get_settings

    try:
        tokens = get_settings().tenant_tokens()
    except ValueError as exc:  # a duplicated token: refuse to start rather than guess its tenant
        _fail(str(exc), 2, "usage")
    if not tokens and not insecure_local:
        _fail("TOOLOOP_API_TOKENS is empty: set it (token=tenant,...), or pass --insecure-local "
              "to serve this machine only, signed in as tenant default", 2, "usage")  # fmt: skip
    if insecure_local and host not in LOOPBACK:
        _fail(f"--insecure-local serves loopback only (127.0.0.1), not {host}", 2, "usage")
    from orchestrator.api import serve  # FastAPI only here: other commands stay fast

    serve(host, port, loglevel, insecure_local=insecure_local)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
