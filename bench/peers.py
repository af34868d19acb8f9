"""The same agent on tooloop and on its durable peers, measured in one run.

Every system runs the agent of bench/peers/loop.py: 10 tool-turns of ``add``, then an
answer, against the same scripted OpenAI-compatible model over HTTP (in this process),
through litellm in every case:

  tooloop    its defaults: a ``tooloop worker`` (turns and tools pools, every tool call
             sandboxed) on a private redis-server; the producer submits and waits;
  dbos       DBOS Transact on the local PostgreSQL: a workflow, one step per model call
             and one per tool call;
  langgraph  LangGraph's prebuilt ReAct agent, its Postgres checkpointer written at
             every step (``durability="sync"``);
  inprocess  a plain litellm loop, nothing kept: the floor.

Each system runs in a process of its own (bench/peers/driver.py). Per system, from one run:

  CPU per tool-turn   user + sys from /proc of all its processes (the driver, tooloop's
                      worker tree with its reaped sandbox processes) and of its database
                      (the private redis-server, or every PostgreSQL server process):
                      (CPU of N runs x 10 tool-turns - CPU of N one-turn runs) / 10 N,
                      the N runs of a phase started at once;
  latency per tool-turn  one run at a time: (T(10 tool-turns) - T(0)) / 10, medians;
  memory              RSS (and PSS) summed over the system's processes, database excluded;
  store per run       the store's growth over the N 10-turn runs, / N: Redis MEMORY USAGE
                      of tooloop's keys; the bytes of the peer's rows (pg_column_size,
                      indexes and dead row versions not counted);
  kill -9 mid-run     the whole system is killed -9 during its 5th tool call, then
                      started again as a supervisor would (the same command): does the run
                      end without being called again, and is a tool call executed twice
                      (LangGraph does not go on by itself: it is then invoked again on its
                      thread, as its docs say, and its repeats counted).

    python bench/peers.py [--quick] [--json] [--systems tooloop,dbos,langgraph,inprocess]

``--quick``: 10 runs a phase and 3 latency rounds (under 5 minutes here); the default
40 and 7. ``--json``: one document on stdout, ``{"systems": {"tooloop": {...}, ...}}``.
Needs the extra ``peers`` (``pip install -e '.[peers]'``) and PostgreSQL (PEERS_PG_URL,
default postgresql://postgres@127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import REDIS_PID, ROOT, environment, median, publish, scripted_model, write_result
from bench.peers.loop import PAUSE_A, executed, repeated, steps

TOOL_TURNS, KILL_AT = 10, 5
ORDER = ("tooloop", "dbos", "langgraph", "inprocess")
PG = os.environ.get("PEERS_PG_URL", "postgresql://postgres@127.0.0.1:5432")
RESUME_WAIT_S = {"tooloop": 120.0, "dbos": 60.0, "langgraph": 10.0, "inprocess": 5.0}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Driver:
    """One system's process (bench/peers/driver.py), in a process group of its own."""

    def __init__(self, system: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.peers.driver", system], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)  # fmt: skip
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"{system} driver exited {self.proc.wait()}")

    def call(self, op: str, **fields):
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"ok": false, "error": "driver exited"}')
        if not reply["ok"]:
            raise RuntimeError(f"{op}: {reply['error']}")
        return reply

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        with suppress(BrokenPipeError, OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


def postgres_root() -> int | None:
    """The postmaster: its tree's CPU (with the backends it reaped) is the server's."""
    everything = {p.pid: p for p in (procs.read(int(d)) for d in os.listdir("/proc") if d.isdigit()) if p}
    for p in everything.values():
        parent = everything.get(p.ppid)
        if p.name == "postgres" and (parent is None or parent.name != "postgres"):
            return p.pid
    return None


def fresh_database(name: str) -> str:
    import psycopg

    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return f"{PG}/{name}"


def pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


class Bench:
    """One system: its processes, its database, its driver; the phases of the docstring."""

    def __init__(self, system: str, env: dict[str, str], model_server, runs: int, rounds: int) -> None:
        self.system, self.model_server, self.runs, self.rounds = system, model_server, runs, rounds
        self.effects = tempfile.mkdtemp(prefix=f"peers-{system}-")
        os.chmod(self.effects, 0o777)
        self.env = {**env, "PEERS_API_BASE": model_server.api_base, "PEERS_EFFECTS": self.effects}
        self.db_pid: int | None = None
        if system in ("dbos", "langgraph"):
            self.env["PEERS_PG"] = fresh_database(f"peers_{system}")
            self.db_pid = postgres_root()
        elif system == "tooloop":
            self.db_pid = REDIS_PID[0] if REDIS_PID else None
        self.worker = None
        self.start()

    def start(self) -> None:
        if self.system == "tooloop":
            from orchestrator import Client
            from orchestrator.local import WorkerProcess

            self.worker = WorkerProcess(f"peers-{uuid.uuid4().hex[:6]}", env=self.env)
            self.worker.wait_ready(Client().store)
        self.driver = Driver(self.system, self.env)

    def kill(self) -> None:
        self.driver.kill()
        if self.worker is not None:
            self.worker.kill()
            self.worker.proc.wait()

    def stop(self) -> None:
        self.driver.stop()
        if self.worker is not None:
            self.worker.stop()

    def pids(self) -> list[int]:
        return [self.driver.proc.pid, *([self.worker.proc.pid] if self.worker else [])]

    def cpu(self) -> tuple[float, float]:
        """CPU s so far of the system's processes, and of its database."""
        own = sum(procs.cpu_of_tree(pid) for pid in self.pids())
        db = procs.cpu_of_tree(self.db_pid) if self.db_pid else 0.0
        return own, db

    def memory(self) -> tuple[float, float]:
        everything = [p for pid in self.pids() for p in procs.tree(pid)]
        return sum(p.rss for p in everything) / 2**20, sum(pss(p.pid) for p in everything) / 2**20

    def batch(self, tool_turns: int, runs: int) -> tuple[float, float, float]:
        model = self.model_server.script(steps(tool_turns))
        own0, db0 = self.cpu()
        run_ids = [uuid.uuid4().hex for _ in range(runs)]
        wall = self.driver.call("batch", model=model, run_ids=run_ids)["wall_s"]
        own1, db1 = self.cpu()
        return own1 - own0, db1 - db0, wall

    def one(self, model: str) -> float:
        return self.driver.call("run", model=model, run_id=uuid.uuid4().hex)["wall_s"]

    def measure(self) -> dict:
        self.batch(3, 4)  # warm-up: imports, connection pools, the prefork children
        n, ms = self.runs, 1000
        plain_own, plain_db, _ = self.batch(0, n)
        store0 = self.driver.call("store_bytes")["value"]
        tool_own, tool_db, wall = self.batch(TOOL_TURNS, n)
        store1 = self.driver.call("store_bytes")["value"]
        rss, pss_mb = self.memory()
        per_cpu = ((tool_own + tool_db) - (plain_own + plain_db)) / (n * TOOL_TURNS)
        per_db = (tool_db - plain_db) / (n * TOOL_TURNS)
        long, short = self.model_server.script(steps(TOOL_TURNS)), self.model_server.script(steps(0))
        t10, t0 = [], []
        for _ in range(self.rounds):
            t10.append(self.one(long))
            t0.append(self.one(short))
        return {
            "cpu_ms_per_tool_turn": round(per_cpu * ms, 2),
            "db_cpu_ms_per_tool_turn": round(per_db * ms, 2),
            "cpu_ms_all_in_per_tool_turn": round((tool_own + tool_db) / (n * TOOL_TURNS) * ms, 2),
            "cpu_ms_per_plain_run": round((plain_own + plain_db) / n * ms, 2),
            "latency_ms_per_tool_turn": round((median(t10) - median(t0)) / TOOL_TURNS * ms, 2),
            "tool_turns_per_s": round(n * TOOL_TURNS / wall, 1),
            "rss_mb": round(rss, 1),
            "pss_mb": round(pss_mb, 1),
            "store_bytes_per_run": round((store1 - store0) / n),
            "versions": self.driver.call("versions")["value"],
        }

    def effects_folder(self, run_id: str) -> str:
        return os.path.join(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id) if self.system == "tooloop" \
            else self.effects  # fmt: skip

    def kill_test(self) -> dict:
        """kill -9 during the 5th tool call, start the system again, see what it does."""
        script = steps(TOOL_TURNS, kill_at=KILL_AT)
        model = self.model_server.script(script)
        run_id = uuid.uuid4().hex
        folder = self.effects_folder(run_id)
        self.driver.call("start", model=model, run_id=run_id)
        deadline = time.monotonic() + 120
        while f"{PAUSE_A}+{KILL_AT}" not in executed(folder):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.system}: the run never reached its kill point")
            time.sleep(0.02)
        self.kill()
        started = time.monotonic()
        self.start()
        resumed = self.driver.call("finished", run_id=run_id, timeout=RESUME_WAIT_S[self.system])["value"]
        took = time.monotonic() - started
        completed = resumed
        if not resumed and self.driver.call("resume", model=model, run_id=run_id)["value"]:
            completed = self.driver.call("finished", run_id=run_id, timeout=30)["value"]
        return {
            "resumes_after_kill": bool(resumed),
            "resume_s": round(took, 1) if resumed else None,
            "completed_after_kill": bool(completed),
            "tool_calls_repeated_after_kill": repeated(folder, script),
        }


def measure_system(system: str, env: dict[str, str], model_server, args) -> dict:
    log(f"peers: {system} ...")
    bench = Bench(system, env, model_server, args.runs, args.rounds)
    try:
        out = bench.measure()
        if args.kill:
            out |= bench.kill_test()
        return out
    finally:
        bench.stop()
        shutil.rmtree(bench.effects, ignore_errors=True)


def report(args, head: list[str], systems: dict[str, dict]) -> list[str]:
    lines = [
        f"peers: the same agent ({TOOL_TURNS} tool-turns of add, then an answer; scripted model over HTTP, "
        f"litellm), {args.runs} runs a phase, {args.rounds} latency rounds, one run",
        *head,
        f"  {'system':<10} {'CPU/tool-turn':>13} {'(db)':>6} {'latency':>8} {'RSS MB':>7} {'PSS MB':>7} "
        f"{'store/run':>10} {'resumes':>8} {'repeats':>8}",
    ]
    for name, s in systems.items():
        resumes = {True: f"yes {s.get('resume_s')}s", False: "no"}.get(s.get("resumes_after_kill"), "-")
        repeats = s.get("tool_calls_repeated_after_kill", "-")
        lines.append(
            f"  {name:<10} {s['cpu_ms_per_tool_turn']:>10.2f} ms {s['db_cpu_ms_per_tool_turn']:>6.2f} "
            f"{s['latency_ms_per_tool_turn']:>5.2f} ms {s['rss_mb']:>7.0f} {s['pss_mb']:>7.0f} "
            f"{s['store_bytes_per_run'] / 1024:>6.1f} KiB {resumes:>8} {repeats:>8}"
        )  # fmt: skip
    for name, s in systems.items():
        lines.append(f"  {name} versions: " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 runs a phase, 3 latency rounds")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--systems", default=",".join(ORDER))
    parser.add_argument("--runs", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="skip the kill -9 test")
    args = parser.parse_args()
    args.runs = args.runs or (10 if args.quick else 40)
    args.rounds = args.rounds or (3 if args.quick else 7)
    with ExitStack() as stack:
        env = environment(stack, "bench.peers.tools")
        model_server = scripted_model()
        stack.callback(model_server.stop)
        from orchestrator import Client

        head = [*procs.machine(Client().store.redis), procs.load_average(), f"  git {procs.git_head()}"]
        worker_env = {**os.environ, **env}
        names = args.systems.split(",")
        systems = {name: measure_system(name, worker_env, model_server, args) for name in names}
    head.append(procs.load_average().replace("at start", "at the end"))
    lines = report(args, head, systems)
    name = "peers_quick" if args.quick else "peers"
    if args.json:
        print(json.dumps({"systems": systems, "machine": head}, indent=2))
        log("\n".join(lines))
        log(f"written to {write_result(name, chr(10).join(lines) + chr(10))}")
    else:
        publish(name, lines)


if __name__ == "__main__":
    main()
