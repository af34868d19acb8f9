"""Real parts: a Redis, Celery workers as subprocesses, a scripted model over HTTP.

The suite uses ``TOOLOOP_REDIS_URL`` (default 127.0.0.1:6379) if it answers,
else starts a throwaway ``redis-server``; every session gets its own key prefix,
so runs never collide with other sessions sharing the server.

Broker/store matrix: the loop, durability and control suites run once per stack
(``--stacks``, default from ``TOOLOOP_TEST_STACKS`` or all of them):
  redis    Redis as broker and store
  amqp     RabbitMQ as broker (a vhost of this session's own), Redis as store
  cluster  a Redis Cluster of three primaries (started for the session by
           tests/servers.py) as store, the session's plain Redis as broker (kombu
           cannot use a cluster)
  amqp-cluster  RabbitMQ as broker, a Redis Cluster as store
A stack whose servers are missing is skipped, with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.local import WorkerProcess, free_port, redis_answers, stop_with_parent

ROOT = Path(__file__).resolve().parent.parent
_started: list[subprocess.Popen] = []


def start_redis(port: int, *extra: str) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.exit("no Redis answers and redis-server is not installed", 2)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=stop_with_parent,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if redis_answers(url):
            return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


STACKS = ("redis", "amqp", "cluster", "amqp-cluster")
MATRIX_MODULES = {"test_loop", "test_durability", "test_control"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stacks", default=os.environ.get("TOOLOOP_TEST_STACKS", ",".join(STACKS)),
        help="broker/store pairings the loop, durability and control suites run on "
             f"(comma-separated among {', '.join(STACKS)})",
    )  # fmt: skip
    parser.addoption(
        "--fast", action="store_true",
        help="the inner loop (make test-fast): tests that start no worker and no model, and one "
             "end-to-end test per capability (SMOKE), on the default stack only",
    )  # fmt: skip


# make test-fast: one end-to-end test per capability, on the default stack, beside every test
# that needs no worker and no model (module.py::function, all its parameters).
SMOKE = frozenset({
    "test_loop.py::test_default_exit_with_one_tool_call",
    "test_control.py::test_pause_parks_between_steps_and_resume_continues",
    "test_durability.py::test_kill_during_model_call",
    "test_faults.py::test_a_poison_tool_call_ends_the_run_within_its_attempt_cap",
    "test_supervisor.py::test_tool_repeated_abort_names_the_rule",
    "test_approval.py::test_denied_call_reaches_the_model_as_a_failed_record",
    "test_sandbox.py::test_e2e_hostile_calls_are_contained_and_the_run_goes_on",
    "test_api.py::test_submit_over_http_runs_for_the_tokens_tenant",
    "test_cli.py::test_submit_wait_json_prints_one_document_and_exits_0",
    "test_streaming.py::test_streamed_text_is_kept_only_in_the_event_stream",
    "test_compaction.py::test_summary_call_made_and_pairs_intact",
    "test_providers.py::test_fallbacks_are_tried_in_order",
    "test_scrub.py::test_no_credential_from_a_tool_output_is_stored_or_shown",
    "test_bounds.py::test_huge_tool_output_is_bounded_for_the_model_and_in_redis",
    "test_text_calls.py::test_text_call_runs_the_tool",
    "test_http_tools.py::test_calls_with_templates_bounds_and_failures",
    "test_mcp.py::test_run_calls_stdio_and_http_servers",
    "test_agents.py::test_steering_and_skills_reach_the_models_system_prompt",
    "test_events.py::test_unknown_or_misfit_events_reach_readers_as_plain_events",
    "test_security.py::test_sealed_key_opens_only_for_its_tenant",
    "test_metrics.py::test_a_scrape_after_a_run_shows_the_counters_moved",
    "test_console.py::test_a_cli_run_appears_live_and_its_page_fills_turn_by_turn",
    "test_children.py::test_one_child_then_two_in_parallel_then_a_failing_one",
    "test_fork.py::test_fork_at_the_first_turn_the_middle_and_after_the_last",
    "test_replay.py::test_a_changed_tool_output_is_found_live",
})  # fmt: skip


def short_name(item: pytest.Item) -> str:
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def is_fast(item: pytest.Item) -> bool:
    if short_name(item) in SMOKE:
        return True
    return not (SLOW_FIXTURES & set(item.fixturenames)) and short_name(item) not in NOT_FAST


# What a test needs that makes it slow: workers, the scripted model, servers of its own.
SLOW_FIXTURES = frozenset({"worker", "deployment", "model_server", "spec", "aof_redis", "amqp_url", "sbx",
                           "site"})  # fmt: skip
# A test that runs a suite of its own in a subprocess.
NOT_FAST = frozenset({"test_sandbox.py::test_the_hostile_suite_holds_under_docker_default_seccomp"})
# Module fixtures costly to set up (workers, the sandbox matrix's cells, a six-node Redis Cluster,
# a wheelhouse, an MCP host, Chromium): the tests that use one run in a single xdist process, so
# it is set up once.
SHARED_MODULE_FIXTURES = frozenset({"sbx", "cells", "cluster", "wheelhouse", "mcp_shared", "browser"})


def pytest_configure(config: pytest.Config) -> None:
    url = os.environ.get("TOOLOOP_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not redis_answers(url):
        port = free_port()
        _started.append(start_redis(port))
        url = f"redis://127.0.0.1:{port}/0"
    os.environ["TOOLOOP_REDIS_URL"] = url
    os.environ["TOOLOOP_KEY_PREFIX"] = f"test-{uuid.uuid4().hex[:8]}"
    os.environ["TOOLOOP_TOOLS"] = "tests.tools"
    # The shared workers' leases (10 s: the default R / 6) outlast the stalls of a loaded box: a
    # test that does not kill or freeze workers must not see a turn taken over. A deployment
    # (tests that kill, freeze or starve workers) gets TOOLOOP_RECOVERY_S=6 (leases of 3 s)
    # unless it says.
    os.environ["TOOLOOP_RECOVERY_S"] = os.environ.get("TOOLOOP_RECOVERY_S", "60")
    os.environ["TOOLOOP_SANDBOX_ROOT"] = tempfile.mkdtemp(prefix="tooloop-test-")
    os.environ["TOOLOOP_SANDBOX_ALLOW"] = tempfile.mkdtemp(prefix="tooloop-allow-")  # context.sandbox_root
    os.environ["TOOLOOP_SECRET_KEY"] = "test-secret"
    os.environ["OPENAI_API_KEY"] = "sk-test"
    # The scripted model is the one endpoint the workers' keys may go to (besides providers').
    os.environ["TOOLOOP_TEST_MODEL_PORT"] = str(free_port())
    os.environ["TOOLOOP_ALLOWED_API_BASES"] = f"http://127.0.0.1:{os.environ['TOOLOOP_TEST_MODEL_PORT']}/v1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # Workers are forked from an interpreter that imported their libraries once (~1-2 s of CPU
    # per worker instead of ~7): orchestrator/forkserver.py. Started now, with this clean
    # environment; a worker whose environment differs in more than TOOLOOP_* and provider keys
    # (or that runs wrapped, as another user, in another sandbox) starts as a fresh interpreter.
    controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
    if not hasattr(config, "workerinput"):  # once per session: what killed sessions left in RabbitMQ
        from tests.servers import drop_stale_vhosts

        drop_stale_vhosts()
    if os.environ.get("TOOLOOP_TEST_FORK_SERVER", "1") != "0" and not controller:  # xdist's starts none
        from orchestrator.forkserver import ForkServer

        WorkerProcess.fork_server = ForkServer()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stack" in metafunc.fixturenames and metafunc.module.__name__.rsplit(".", 1)[-1] in MATRIX_MODULES:
        wanted = [s.strip() for s in metafunc.config.getoption("stacks").split(",") if s.strip()]
        unknown = set(wanted) - set(STACKS)
        if unknown:
            raise pytest.UsageError(f"--stacks: unknown {sorted(unknown)}; known: {', '.join(STACKS)}")
        metafunc.parametrize("stack", wanted, indirect=True, scope="session")


def stack_of(item: pytest.Item) -> str | None:
    return getattr(getattr(item, "callspec", None), "params", {}).get("stack")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One stack after the other (the default one first), so that in one process each
    stack's worker starts once. Under pytest-xdist (``make test``) each stack but the
    default one is also a group that a single process runs from start to end: its servers
    and worker start once in the whole session (xdist hands out the largest groups first);
    so are the tests of a module that share a costly module fixture."""
    if config.getoption("fast"):
        keep = [i for i in items if is_fast(i) and stack_of(i) in (None, "redis")]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    items.sort(key=lambda item: STACKS.index(stack_of(item) or "redis"))
    for item in items:
        stack = stack_of(item)
        if stack not in (None, "redis"):
            item.add_marker(pytest.mark.xdist_group(f"stack-{stack}"))
        elif SHARED_MODULE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_unconfigure(config: pytest.Config) -> None:
    for stack in _STACKS.values():
        stack.close()
    if WorkerProcess.fork_server is not None:
        WorkerProcess.fork_server.stop()
    _Vhost.stop()  # also when only the amqp_url fixture made it (no amqp stack)
    import redis

    try:
        client = redis.Redis.from_url(os.environ["TOOLOOP_REDIS_URL"])
        keys = list(client.scan_iter(f"{os.environ['TOOLOOP_KEY_PREFIX']}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    except Exception:
        pass
    for proc in _started:
        proc.terminate()


@pytest.fixture(autouse=True)
def _settings_follow_the_environment() -> Iterator[None]:
    """A test that changes TOOLOOP_* (monkeypatch) may build the cached settings meanwhile;
    the next test in this process would read its values (CI: another test's allowed API base
    refused the scripted model's). Dropped after every test: rebuilt in ~1 ms."""
    from orchestrator.settings import get_settings

    yield
    get_settings.cache_clear()


# -- model --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def model_server() -> Iterator:
    from orchestrator.scripted_model import ScriptedModel

    server = ScriptedModel(port=int(os.environ["TOOLOOP_TEST_MODEL_PORT"])).start()
    yield server
    server.stop()


# -- stacks: broker/store pairings ------------------------------------------------------------
class Stack:
    """One broker/store pairing: its TOOLOOP_* overrides, store, client and (on first use)
    its shared worker. Only one stack's worker runs at a time."""

    def __init__(self, name: str, env: dict[str, str], servers: list | None = None) -> None:
        from orchestrator import Client
        from orchestrator.settings import Settings, get_settings
        from orchestrator.store import RunStore

        self.name, self.env, self.servers = name, env, servers or []
        self.settings = Settings(**settings_fields(env)) if env else get_settings()
        self.store = RunStore.from_settings(self.settings)
        self.client = Client(settings=self.settings, store=self.store)
        self._worker: WorkerProcess | None = None

    def worker(self) -> WorkerProcess:
        if self._worker is None:
            for other in _STACKS.values():
                if other is not self:
                    other.stop_worker()
            proc = WorkerProcess(f"main-{self.name}-{uuid.uuid4().hex[:6]}", "-c", "4", env=self.env)
            self._worker = proc.wait_ready(self.store)
        return self._worker

    def stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def queued(self, queue: str, celery_app=None) -> int:
        """Messages waiting in one of this stack's queues (whatever the broker)."""
        from orchestrator.broker import queue_depths

        return queue_depths(celery_app or self.client.celery, [queue])[queue] or 0

    def close(self) -> None:
        self.stop_worker()
        for server in self.servers:
            server.stop()


_STACKS: dict[str, Stack] = {}


def settings_fields(env: dict[str, str]) -> dict[str, str]:
    return {k.removeprefix("TOOLOOP_").lower(): v for k, v in env.items() if k.startswith("TOOLOOP_")}


class _Vhost:
    """The session's RabbitMQ vhost, made on first use, dropped at the end."""

    vhost = None

    @classmethod
    def url(cls) -> str:
        from tests.servers import AMQP_URL, RabbitVhost, vhost_name

        base = os.environ.get("TOOLOOP_TEST_AMQP_URL", AMQP_URL)
        if cls.vhost is None and not cls._answers(base):
            why = f"RabbitMQ does not answer at {base} (set TOOLOOP_TEST_AMQP_URL)"
            if os.environ.get("TOOLOOP_TEST_REQUIRE_AMQP"):  # CI started one: its loss is a failure
                pytest.fail(why)
            pytest.skip(why)
        if cls.vhost is None:
            cls.check_budget()
            cls.vhost = RabbitVhost(base, vhost_name(os.environ["TOOLOOP_KEY_PREFIX"]))
        return cls.vhost.url

    @staticmethod
    def check_budget() -> None:
        """At most four test processes use RabbitMQ at once: the amqp stacks' groups,
        test_rabbitmq's, and one more (test_cluster's)."""
        from tests.servers import check_handle_budget

        try:
            check_handle_budget(min(4, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
        except RuntimeError as e:
            pytest.fail(str(e))

    @staticmethod
    def _answers(base: str, within: float = 30) -> bool:
        """A loaded machine may take seconds to answer a handshake: not a reason to skip."""
        from tests.servers import amqp_answers

        deadline = time.monotonic() + within
        while not amqp_answers(base):
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True

    @classmethod
    def stop(cls) -> None:
        if cls.vhost is not None:
            cls.vhost.delete()
            cls.vhost = None


def make_stack(name: str) -> Stack:
    if name == "redis":
        return Stack(name, {})
    if name == "amqp":
        return Stack(name, {"TOOLOOP_BROKER_URL": _Vhost.url()}, servers=[_Vhost])
    if name == "cluster":
        return cluster_stack(name, os.environ["TOOLOOP_REDIS_URL"])
    if name == "amqp-cluster":
        return cluster_stack(name, _Vhost.url(), [_Vhost])
    raise ValueError(name)


def cluster_stack(name: str, broker: str, others: list | None = None) -> Stack:
    """A 3-primary Redis Cluster as store; ``broker``: the session's plain Redis or its
    RabbitMQ vhost (kombu cannot use a cluster)."""
    from tests.servers import RedisCluster

    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server and redis-cli are needed to start a Redis Cluster")
    cluster = RedisCluster(masters=3)
    env = {"TOOLOOP_REDIS_URL": cluster.url, "TOOLOOP_BROKER_URL": broker}
    try:
        return Stack(name, env, servers=[cluster, *(others or [])])
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """This session's RabbitMQ vhost, as a broker URL (skips where RabbitMQ is absent)."""
    return _Vhost.url()


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Stack:
    """The broker/store pairing of this test (the default one outside the matrix)."""
    name = getattr(request, "param", "redis")
    if name not in _STACKS:
        _STACKS[name] = make_stack(name)
    return _STACKS[name]


# -- workers ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def store(stack):
    return stack.store


@pytest.fixture(scope="session")
def client(stack):
    return stack.client


@pytest.fixture(scope="session")
def worker(stack) -> WorkerProcess:
    return stack.worker()


class Deployment:
    """A deployment of its own: key prefix, client, store, workers."""

    def __init__(self, prefix: str, env: dict[str, str]) -> None:
        from orchestrator import Client
        from orchestrator.settings import Settings
        from orchestrator.store import RunStore

        self.prefix, self.env = prefix, {"TOOLOOP_KEY_PREFIX": prefix, "TOOLOOP_RECOVERY_S": "6", **env}
        self.settings = Settings(**settings_fields(self.env))
        self.store = RunStore.from_settings(self.settings)
        self.client = Client(settings=self.settings, store=self.store)
        self.workers: list[WorkerProcess] = []

    def start_worker(self, *args: str, roles: tuple[str, ...] = ("turns", "tools"),
                     env: dict[str, str] | None = None) -> WorkerProcess:  # fmt: skip
        proc = WorkerProcess(f"{self.prefix}-{len(self.workers)}", *args, env={**self.env, **(env or {})})
        self.workers.append(proc)
        return proc.wait_ready(self.store, roles)

    def start_workers(self, count: int, *args: str) -> list[WorkerProcess]:
        """``count`` workers started together, each ready on return: their starts overlap (on
        a loaded box each start waits on the CPU, not on the others)."""
        procs = [WorkerProcess(f"{self.prefix}-{len(self.workers) + i}", *args, env=self.env)
                 for i in range(count)]  # fmt: skip
        self.workers += procs
        return [proc.wait_ready(self.store) for proc in procs]

    def queued(self, queue: str) -> int:
        """Messages waiting in one of this deployment's queues (whatever the broker)."""
        from orchestrator.broker import queue_depths

        return queue_depths(self.client.celery, [queue])[queue] or 0

    def stop(self) -> None:
        for proc in self.workers:
            proc.stop()
        if self.env.get("TOOLOOP_BROKER_URL", "").startswith("amqp"):
            from tests.servers import drop_queues

            drop_queues(self.env["TOOLOOP_BROKER_URL"], self.store.keys)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def deployment(stack, request: pytest.FixtureRequest) -> Iterator:
    """Factory: ``deployment(**env)`` -> a Deployment with no workers yet (for tests that
    starve, kill or count workers without disturbing the shared one), on the test's stack.
    When the test fails, its workers' last log lines are printed (the report shows them)."""
    made: list[Deployment] = []

    def make(**env: str) -> Deployment:
        d = Deployment(f"{os.environ['TOOLOOP_KEY_PREFIX']}-{uuid.uuid4().hex[:6]}", {**stack.env, **env})
        made.append(d)
        return d

    yield make
    failed = request.node.stash.get(CALL_FAILED, False)
    for d in made:
        d.stop()
        for proc in d.workers if failed else []:
            print(f"--- worker {proc.name} (last lines of {proc.log}) ---\n{proc.tail(6000)}")


@pytest.fixture
def holds() -> Iterator[list]:
    """Events that keep scripted model steps waiting (see helpers.gate); released at teardown."""
    made: list = []
    yield made
    for event in made:
        event.set()


@pytest.fixture
def spec(model_server):
    """Build a spec dict that talks to the scripted model."""

    def make(steps, **fields):
        model = model_server.script(steps)
        params = {"api_base": model_server.api_base, **fields.pop("model_params", {})}
        return {"prompt": "do the task", "model": model, "model_params": params, **fields}

    return make


# -- a Redis of the test's own (restart it, stop it) ----------------------------------
@pytest.fixture
def aof_redis(tmp_path):
    """A Redis of our own with AOF on (as deploy/ and docker-compose.yml configure it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--maxmemory-policy", "noeviction"]  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"

    class Server:
        proc: subprocess.Popen

        def start(self) -> None:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, preexec_fn=stop_with_parent)
            from tests.helpers import wait_for

            wait_for(lambda: redis_answers(url), timeout=10)

        def restart(self) -> None:
            self.proc.terminate()  # SIGTERM: Redis flushes the AOF and exits
            self.proc.wait(timeout=10)
            time.sleep(1.0)  # workers see the connection drop
            self.start()

    server = Server()
    server.url = url
    server.start()
    yield server
    server.proc.kill()
