"""The sweeper's look into a broker queue at a 20,000, 100,000 and 1,000,000-message backlog.

A late step's message is looked for in its queue (a kombu list on Redis) before the step
is sent again. The look used to be one Lua script over the whole list; it is now one
slice of ``QUEUE_SCAN_SLICE`` entries per script, newest first, at most ``QUEUE_SCAN_MAX``
entries per look (``RunStore.queued``). What counts is how long Redis answers nobody
else: the longest single command, from Redis's own slow log (time inside the server).

A private redis-server; messages of ~330 bytes shaped as kombu writes them; five ids
looked for (the oldest, the middle, the newest, two that are not there).

    python bench/queue_scan.py [--depths 20000,100000,1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import private_redis, publish

# The script the sweeper ran before (one pass over the whole list), for the comparison.
ONE_PASS = """
local want = {}
for i = 1, #ARGV do want[ARGV[i]] = true end
local found, n = {}, redis.call('LLEN', KEYS[1])
for start = 0, n - 1, 1000 do
  for _, m in ipairs(redis.call('LRANGE', KEYS[1], start, start + 999)) do
    local id = string.match(m, '"id": ?"([^"]+)"')
    if id and want[id] then found[#found + 1] = id want[id] = nil end
  end
end
return found
"""


def message(i: int) -> str:
    return json.dumps({"body": "e" * 200, "content-encoding": "utf-8",
                       "headers": {"lang": "py", "task": "tooloop.turn", "id": f"t-{i}"},
                       "properties": {"delivery_tag": f"tag-{i}"}})  # fmt: skip


def fill(r, queue: str, depth: int) -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(depth):
        pipe.lpush(queue, message(i))
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()


def longest(r) -> str:
    """The longest command Redis logged since the last reset (it logs those over 10 ms)."""
    ms = max((e["duration"] for e in r.slowlog_get(1024)), default=0) / 1000
    return f"{ms:,.0f} ms" if ms else "under 10 ms"


def main() -> None:
    import redis

    from orchestrator import store as store_module
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore

    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="20000,100000,1000000")
    args = parser.parse_args()
    lines = [f"the sweeper's look into a broker queue: slices of {store_module.QUEUE_SCAN_SLICE:,} entries, "
             f"at most {store_module.QUEUE_SCAN_MAX:,} per look (newest first)"]  # fmt: skip
    with ExitStack() as stack:
        r = redis.Redis.from_url(private_redis(stack), socket_timeout=None)  # one pass: tens of seconds
        store = RunStore(r, Settings(key_prefix="bench-scan"))
        one_pass = r.register_script(ONE_PASS)
        for depth in (int(d) for d in args.depths.split(",")):
            queue = "bench-scan.turns"
            r.delete(queue)
            fill(r, queue, depth)
            wanted = ["t-0", f"t-{depth // 2}", f"t-{depth - 1}", "t-gone", "t-also-gone"]
            r.slowlog_reset()
            started = time.monotonic()
            old = {x.decode() for x in one_pass(keys=[queue], args=wanted)}
            old_s, old_block = time.monotonic() - started, longest(r)
            r.slowlog_reset()
            started = time.monotonic()
            new = store.queued(r, queue, wanted)
            new_s, new_block = time.monotonic() - started, longest(r)
            capped = depth > store_module.QUEUE_SCAN_MAX
            lines.append(f"  {depth:>9,} messages: one pass held Redis {old_block} "
                         f"({old_s:.1f} s wall); slices: longest command {new_block}, "
                         f"the whole look {new_s * 1000:,.0f} ms; "
                         f"{len(new)} of 5 counted waiting"
                         + (" (past the cap: not reached, so not taken for lost)" if capped else
                            f" (one pass found {len(old)})"))  # fmt: skip
            r.delete(queue)
    lines.append(f"load average while measured: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    publish("queue_scan", lines)


if __name__ == "__main__":
    main()
