"""Child runs end to end, and the CPU a child run costs against a plain run, in one run.

One ``tooloop worker`` with its defaults, the scripted model answering at once, a
private redis-server (``bench/common.py``). Three phases, each all submitted at once:

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

    python bench/children.py [--parents 100] [--plain 100]
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
from bench.common import REDIS_PID, environment, local_worker, publish, scripted_spec

KIDS = "abc"


@dataclass
class Phase:
    runs: int  # top-level runs submitted
    child_runs: int
    wall_s: float
    cpu_s: float  # worker tree + Redis
    redis_cpu_s: float


class Bench:
    def __init__(self, client, model_server, worker_pid: int) -> None:
        self.client, self.model_server, self.worker_pid = client, model_server, worker_pid
        self.redis_pid = REDIS_PID[0] if REDIS_PID else None

    def cpu(self) -> tuple[float, float]:
        redis_cpu = procs.cpu_of(self.redis_pid) if self.redis_pid else 0.0
        return procs.cpu_of_tree(self.worker_pid) + redis_cpu, redis_cpu

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
        started = time.perf_counter()
        handles = [self.client.submit(spec) for spec in specs]
        for handle in handles:
            result = handle.wait(timeout=600)
            assert result.status == "completed", (result.status, result.error)
            assert len(result.children) == kids
            assert all(r.success and r.output == "ok" for r in result.tool_calls), result.tool_calls
        wall = time.perf_counter() - started
        cpu1, redis1 = self.cpu()
        return Phase(len(specs), kids * len(specs), wall, cpu1 - cpu0, redis1 - redis0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parents", type=int, default=100)
    parser.add_argument("--plain", type=int, default=100)
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        client, model_server, worker = local_worker(stack, "children", env=env)
        bench = Bench(client, model_server, worker.proc.pid)
        head = [*procs.machine(client.store.redis), procs.load_average()]
        bench.tree(10, 3)  # warm-up: imports, connection pools, the prefork children
        plain = bench.plain(args.plain)
        three = bench.tree(args.parents, 3)
        one = bench.tree(args.parents, 1)
        head.append(procs.load_average())
    report(args, head, plain, three, one)


def report(args, head: list[str], plain: Phase, three: Phase, one: Phase) -> None:
    ms, p = 1000, args.parents
    per_plain = plain.cpu_s / plain.runs
    per_child = (three.cpu_s - one.cpu_s) / (2 * p)
    redis_plain = plain.redis_cpu_s / plain.runs
    redis_child = (three.redis_cpu_s - one.redis_cpu_s) / (2 * p)
    lines = [
        f"Child runs: one `tooloop worker` (defaults), {p} parents x 3 children (one turn each, "
        "in parallel), scripted model answering at once, one run",
        *head,
        f"  {p} parents x 3 children, end to end   {three.wall_s:7.2f} s   "
        f"({(three.runs + three.child_runs) / three.wall_s:.1f} runs/s; CPU {three.cpu_s:.2f} s)",
        f"  CPU per tree (parent + 3 children)      {three.cpu_s / p * ms:7.2f} ms",
        f"  CPU per plain run (one turn)            {per_plain * ms:7.2f} ms   ({plain.runs} runs)",
        f"  CPU per child run (one turn), marginal  {per_child * ms:7.2f} ms   "
        f"(x{per_child / per_plain:.2f} of a plain run; (tree-3 - tree-1) / 2 x {p})",
        f"  overhead of being a child               {(per_child - per_plain) * ms:7.2f} ms   "
        "(its start in the parent's turn, the record of the parent's call)",
        f"  Redis per plain run / per child run     {redis_plain * ms:7.3f} ms / {redis_child * ms:.3f} ms",
    ]
    publish("children", lines)


if __name__ == "__main__":
    main()
