"""Shares of a py-spy profile (``--format raw``: collapsed stacks), by suspect.

Each sample counts once, for the first suspect (in the order below) with a frame
in its stack; the rest is "other". Also the heaviest self-time frames.

    python bench/profile_shares.py docs/bench/profile-tools-*.txt
"""

from __future__ import annotations

import sys
from collections import Counter

SUSPECTS: list[tuple[str, tuple[str, ...]]] = [
    ("heartbeat / maintenance threads", ("tooloop-heartbeat", "InFlight._beat", "Maintenance.run")),
    ("Celery task events", ("celery/events/", "send_event", "EventDispatcher")),
    ("sandbox fork / spare", ("worker/sandbox",)),
    ("litellm cost calculation", ("cost_calculator", "completion_cost", "_response_cost")),
    ("litellm logging hooks", ("litellm_logging", "litellm/integrations", "Logging.")),
    ("model call, direct route (aiohttp)", ("worker/openai_route", "aiohttp/")),
    ("litellm + openai + httpx (rest)", ("litellm/", "openai/", "httpx/", "httpcore/")),
    ("telemetry / metrics",
     ("worker/observe", "orchestrator/telemetry", "orchestrator/metrics", "prometheus")),
    ("run store (Redis scripts, JSON)", ("orchestrator/store",)),
    ("kombu publish", ("Producer.publish", "send_task", "apply_async")),
    ("kombu consume / ack", ("kombu/",)),
    ("Celery task execution (rest)", ("celery/",)),
    ("redis-py (rest)", ("redis/",)),
    ("json", ("json/",)),
    ("pydantic", ("pydantic",)),
    ("logging", ("logging/",)),
]


def shares(path: str) -> tuple[int, Counter, Counter]:
    by_suspect: Counter = Counter()
    self_time: Counter = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            name = next((s for s, marks in SUSPECTS if any(m in stack for m in marks)), "other")
            by_suspect[name] += n
            leaf = stack.rsplit(";", 1)[-1]
            self_time[leaf.split(" (")[0] + " (" + leaf.split(" (")[-1].split(":")[0]] += n
    return total, by_suspect, self_time


def summary(path: str, title: str) -> list[str]:
    total, by_suspect, self_time = shares(path)
    lines = [f"{title}: {total} samples (threads holding the GIL)"]
    lines += [f"  {100 * n / max(total, 1):5.1f} %  {name}" for name, n in by_suspect.most_common()]
    lines.append("  heaviest self time:")
    lines += [f"  {100 * n / max(total, 1):5.1f} %    {name}" for name, n in self_time.most_common(8)]
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        print("\n".join(summary(path, path)))


if __name__ == "__main__":
    main(sys.argv[1:])
