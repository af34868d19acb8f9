"""A raw Celery hop for the benchmarks: an empty task that sends the next one.

Imported by the benchmark's workers (as a ``--tools`` module), it alternates
between the turns and tools queues, the same route a tool turn takes, with the
same app settings, so the figure is the cost of Celery itself on this machine.
"""

from __future__ import annotations

import json

from worker.app import app, get_store

HOP_TASK = "tooloop.bench.hop"


@app.task(name=HOP_TASK, ignore_result=True)
def hop(remaining: int, queues: list[str], done_key: str) -> None:
    if remaining == 0:
        get_store().redis.rpush(done_key, "done")
        return
    app.send_task(HOP_TASK, args=(remaining - 1, queues[::-1], done_key), queue=queues[1],
                  ignore_result=True)  # fmt: skip


ECHO_TASK = "tooloop.bench.echo"


@app.task(name=ECHO_TASK, ignore_result=False)
def echo(value: int) -> int:
    """A Celery call as producers make them: send, run, store the result, get it back."""
    return value


WHERE_TASK = "tooloop.bench.where"


@app.task(name=WHERE_TASK, ignore_result=True)
def where(done_key: str) -> None:
    """Where this worker process imported its code from: a before/after run checks that each
    system's workers run their own checkout."""
    import orchestrator
    import worker

    get_store().redis.rpush(done_key, json.dumps([orchestrator.__file__, worker.__file__]))
