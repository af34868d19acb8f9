"""Child runs end to end, and the CPU a child run costs against a plain run, in one run.

One ``tooloop worker`` with its defaults, the scripted model answering at once, a
private redis-server (``bench/common.py``). Three phases, each all submitted at once,
repeated (``--rounds``; medians):

  plain   N plain runs of one turn (the answer "ok"): CPU / N per plain run;
  tree-3  P parents, each calling three child agents in one turn (they run at once),
          then answering; each child is one turn answering "ok", like a plain run;
  tree-1  the same P parents calling one child: the parent's own work is the same.

CPU per child run = (CPU(tree-3) - CPU(tree-1)) / 2P: everything one more child costs
the fleet (its start, in the parent's turn; its turn; the record of the parent's call,
by the child's ender; the parent's bigger barrier and history). Its excess over a plain
run is the overhead of being a child. CPU is user + sys from /proc: the ``tooloop
worker`` tree and Redis; the producer (this script) is not counted, as in
bench/cpu_per_turn.py: a plain run's submit is not in its figure, while a child's
start is in the child's.

    python bench/children.py [--parents 100] [--plain 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import REDIS_PID, environment, local_worker, median, publish, scripted_spec

KIDS = "abc"


@dataclass
class Phase:
    runs: int  # top-level runs submitted
    child_runs: int
    wall_s: float
    cpu_s: float  # worker tree + Redis
    redis_cpu_s: float
    submit_cpu_s: float  # this process, submitting (a plain run's start)
    by_role: dict[str, float]  # CPU s per pool (turns, tools, launcher)


class Bench:
    def __init__(self, client, model_server, worker_pid: int) -> None:
        self.client, self.model_server, self.worker_pid = client, model_server, worker_pid
        self.redis_pid = REDIS_PID[0] if REDIS_PID else None

    def cpu(self) -> tuple[float, float]:
        redis_cpu = procs.cpu_of(self.redis_pid) if self.redis_pid else 0.0
        return procs.cpu_of_tree(self.worker_pid) + redis_cpu, redis_cpu

    def roles(self) -> dict[str, float]:
        """CPU so far of each pool's subtree (its Celery worker, pool children, reaped forks)."""
        out: dict[str, float] = {}
        for top in procs.tree(self.worker_pid):
            if top.ppid == self.worker_pid and " -n " in top.cmdline:
                role = top.cmdline.split(" -n ")[1].split("@")[0]
                out[role] = out.get(role, 0.0) + procs.cpu_of_tree(top.pid)
        return out

    def child(self) -> dict:
        spec = scripted_spec(self.model_server, self.model_server.script([{"content": "ok"}]))
        spec.pop("prompt")
        return spec

    def plain(self, runs: int) -> Phase:
        spec = scripted_spec(self.model_server, self.model_server.script([{"content": "ok"}]))
        return self._phase([spec] * runs, 0)

    def tree(self, parents: int, kids: int) -> Phase:
        calls = [{"name": f"agent__{k}", "arguments": {"prompt": "go"}} for k in KIDS[:kids]]
        model = self.model_server.script([{"tool_calls": calls}, {"content": "done"}])
        spec = scripted_spec(self.model_server, model, agents={k: self.child() for k in KIDS[:kids]})
        return self._phase([spec] * parents, kids)

    def _phase(self, specs: list[dict], kids: int) -> Phase:
        cpu0, redis0 = self.cpu()
        roles0 = self.roles()
        started, submit0 = time.perf_counter(), time.process_time()
        handles = [self.client.submit(spec) for spec in specs]
        submit_cpu = time.process_time() - submit0
        for handle in handles:
            result = handle.wait(timeout=600)
            assert result.status == "completed", (result.status, result.error)
            assert len(result.children) == kids
            assert all(r.success and r.output == "ok" for r in result.tool_calls), result.tool_calls
        wall = time.perf_counter() - started
        cpu1, redis1 = self.cpu()
        by_role = {k: v - roles0.get(k, 0.0) for k, v in self.roles().items()}
        return Phase(len(specs), kids * len(specs), wall, cpu1 - cpu0, redis1 - redis0, submit_cpu, by_role)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parents", type=int, default=100)
    parser.add_argument("--plain", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="the three phases this many times: medians")
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        client, model_server, worker = local_worker(stack, "children", env=env)
        bench = Bench(client, model_server, worker.proc.pid)
        head = [*procs.machine(client.store.redis), procs.load_average()]
        bench.tree(10, 3)  # warm-up: imports, connection pools, the prefork children
        rounds = [Round(args.parents, bench.plain(args.plain), bench.tree(args.parents, 3),
                        bench.tree(args.parents, 1)) for _ in range(args.rounds)]  # fmt: skip
        head.append(procs.load_average())
    report(args, head, rounds)


@dataclass
class Round:
    parents: int
    plain: Phase
    three: Phase
    one: Phase

    @property
    def per_plain(self) -> float:
        return self.plain.cpu_s / self.plain.runs

    @property
    def per_child(self) -> float:
        """One more child: (tree-3 - tree-1) / 2 per parent."""
        return (self.three.cpu_s - self.one.cpu_s) / (2 * self.parents)

    @property
    def submit_s(self) -> float:
        """A plain run's submit (validation, the write, the first turn's message), per run."""
        return self.plain.submit_cpu_s / self.plain.runs

    def role_per_child(self, role: str) -> float:
        return (self.three.by_role.get(role, 0) - self.one.by_role.get(role, 0)) / (2 * self.parents)


def report(args, head: list[str], rounds: list[Round]) -> None:
    ms, p = 1000, args.parents

    def med(values: list[float]) -> str:
        mid = median(values) * ms
        return f"{mid:7.2f} ms   (rounds {', '.join(f'{v * ms:.2f}' for v in values)})"

    plain = [r.per_plain for r in rounds]
    child = [r.per_child for r in rounds]
    walls = [r.three.wall_s for r in rounds]
    roles = sorted({role for r in rounds for role in r.three.by_role})
    lines = [
        f"Child runs: one `tooloop worker` (defaults), {p} parents x 3 children (one turn each, "
        f"in parallel), scripted model answering at once; {len(rounds)} rounds of three phases, one run",
        *head,
        f"  {p} parents x 3 children, end to end   {median(walls):7.2f} s   "
        f"({4 * p / median(walls):.1f} runs/s; rounds {', '.join(f'{w:.2f}' for w in walls)} s)",
        f"  CPU per tree (parent + 3 children)   {med([r.three.cpu_s / p for r in rounds])}",
        f"  CPU per plain run (one turn)         {med(plain)}",
        f"    + its submit, in the producer      {med([r.submit_s for r in rounds])}",
        f"  CPU per child run (one turn)         {med(child)}   marginal: (tree-3 - tree-1) / 2 x {p}",
        f"  overhead of being a child            {med([c - q for c, q in zip(child, plain, strict=True)])}",
        f"    = x{median(child) / median(plain):.2f} of a plain run (its start in the parent's turn, the "
        "record of the parent's call by its ender, the parent's bigger barrier)",
        f"  Redis per plain run                  {med([r.plain.redis_cpu_s / r.plain.runs for r in rounds])}",
        f"  Redis per child run                  "
        f"{med([(r.three.redis_cpu_s - r.one.redis_cpu_s) / (2 * p) for r in rounds])}",
        "  per pool, per plain run / per child run (medians): " + ", ".join(
            f"{role} {median([r.plain.by_role.get(role, 0) / r.plain.runs for r in rounds]) * ms:.2f} / "
            f"{median([r.role_per_child(role) for r in rounds]) * ms:.2f} ms" for role in roles),
    ]  # fmt: skip
    publish("children", lines)


if __name__ == "__main__":
    main()
