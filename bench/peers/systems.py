"""Each system's way to run the agent of loop.py, one class each, the same five verbs:

  run(model, run_id)           one run to its answer (blocking)
  batch(model, run_ids)        runs all at once, each to its answer
  start(model, run_id)         a run in the background (the kill test kills the process)
  finished(run_id, timeout)    after a restart: did the run end without being called again?
  resume(run_id)               call it again, as its user would (where that is needed)
  store_bytes()                what the system's store holds now

Environment (set by bench/peers.py): PEERS_API_BASE (the scripted model), PEERS_EFFECTS
(the folder of effects.txt, for the peers), PEERS_PG (a PostgreSQL URL, database included),
and for tooloop the TOOLOOP_* of bench/common.py.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from typing import Any

from bench.peers.loop import SCHEMA, SYSTEM, USER, litellm_message, run_loop, tool_output

API_BASE = os.environ.get("PEERS_API_BASE", "")
EFFECTS = os.environ.get("PEERS_EFFECTS", "")


def quiet_litellm() -> Any:
    import logging

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    logging.getLogger("LiteLLM").setLevel(logging.WARNING)
    return litellm


class System:
    name = ""

    def run(self, model: str, run_id: str) -> None:
        raise NotImplementedError

    def batch(self, model: str, run_ids: list[str]) -> None:
        with ThreadPoolExecutor(len(run_ids)) as pool:
            for future in [pool.submit(self.run, model, run_id) for run_id in run_ids]:
                future.result()

    def start(self, model: str, run_id: str) -> None:
        threading.Thread(target=self.run, args=(model, run_id), daemon=True).start()

    def finished(self, run_id: str, timeout: float) -> bool:
        return False  # nothing of the run outlives its process

    def resume(self, model: str, run_id: str) -> bool:
        return False  # nothing to resume from

    def store_bytes(self) -> int:
        return 0

    def versions(self) -> dict[str, str]:
        return {"litellm": version("litellm")}


class InProcess(System):
    """The floor: litellm and the tool in one loop, nothing kept."""

    name = "inprocess"

    def __init__(self) -> None:
        self.litellm = quiet_litellm()

    def call_model(self, model: str, messages: list[dict]) -> dict:
        reply = self.litellm.completion(model=model, messages=messages, tools=SCHEMA, api_base=API_BASE,
                                        api_key="scripted")  # fmt: skip
        return litellm_message(reply)

    def run(self, model: str, run_id: str) -> None:
        run_loop(lambda messages: self.call_model(model, messages), lambda args: tool_output(args, EFFECTS))


class Postgres(System):
    """A peer keeping its state in PostgreSQL: the bytes of the rows of its schema's tables
    (``pg_column_size``: live rows, indexes and dead versions not counted)."""

    schema = "public"

    def store_bytes(self) -> int:
        import psycopg

        with psycopg.connect(os.environ["PEERS_PG"], autocommit=True) as conn:
            tables = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (self.schema,))
            total = 0
            for (table,) in tables.fetchall():
                query = f'SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM "{self.schema}"."{table}" t'
                total += int(conn.execute(query).fetchone()[0])
            return total

    def versions(self) -> dict[str, str]:
        import psycopg

        with psycopg.connect(os.environ["PEERS_PG"], autocommit=True) as conn:
            server = conn.execute("SHOW server_version").fetchone()[0]
        return {**super().versions(), "postgresql": server.split()[0]}


class Dbos(Postgres):
    """DBOS Transact: a workflow, one step per model call and one per tool call."""

    name = "dbos"
    schema = "dbos"

    def __init__(self) -> None:
        from dbos import DBOS

        from bench.peers import dbos_agent

        self.agent = dbos_agent.agent
        DBOS(config={"name": "peers", "system_database_url": os.environ["PEERS_PG"], "log_level": "WARNING"})
        DBOS.launch()  # recovers this executor's pending workflows (the kill test's restart)

    def start_handle(self, model: str, run_id: str) -> Any:
        from dbos import DBOS, SetWorkflowID

        with SetWorkflowID(run_id):
            return DBOS.start_workflow(self.agent, model, API_BASE, EFFECTS)

    def run(self, model: str, run_id: str) -> None:
        self.start_handle(model, run_id).get_result()

    def batch(self, model: str, run_ids: list[str]) -> None:
        for handle in [self.start_handle(model, run_id) for run_id in run_ids]:
            handle.get_result()

    def start(self, model: str, run_id: str) -> None:
        self.start_handle(model, run_id)

    def finished(self, run_id: str, timeout: float) -> bool:
        from dbos import DBOS

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = DBOS.get_workflow_status(run_id)
            if status is not None and status.status == "SUCCESS":
                return True
            time.sleep(0.2)
        return False

    def versions(self) -> dict[str, str]:
        return {**super().versions(), "dbos": version("dbos")}


class LangGraph(Postgres):
    """LangGraph's prebuilt ReAct agent, its Postgres checkpointer written at every step
    (``durability="sync"``: each step's checkpoint is written before the next step runs)."""

    name = "langgraph"

    def __init__(self) -> None:
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        quiet_litellm()
        kwargs = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
        self.pool = ConnectionPool(os.environ["PEERS_PG"], kwargs=kwargs, max_size=20, open=True)
        self.saver = PostgresSaver(self.pool)
        self.saver.setup()
        self.agents: dict[str, Any] = {}

    def agent(self, model: str) -> Any:
        if model not in self.agents:
            from bench.peers.langgraph_agent import build

            self.agents[model] = build(model, API_BASE, EFFECTS, self.saver)
        return self.agents[model]

    @staticmethod
    def config(run_id: str) -> dict:
        return {"configurable": {"thread_id": run_id}, "recursion_limit": 200}

    def run(self, model: str, run_id: str) -> None:
        self.agent(model).invoke({"messages": [("user", USER)]}, self.config(run_id), durability="sync")

    def finished(self, run_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            tuple_ = self.saver.get_tuple(self.config(run_id))
            if tuple_ is not None and _answered(tuple_):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def resume(self, model: str, run_id: str) -> bool:
        """Invoke the thread again with no input: LangGraph goes on from its last checkpoint."""
        self.agent(model).invoke(None, self.config(run_id), durability="sync")
        return True

    def versions(self) -> dict[str, str]:
        return {**super().versions(), "langgraph": version("langgraph"),
                "langgraph-checkpoint-postgres": version("langgraph-checkpoint-postgres")}  # fmt: skip


def _answered(tuple_: Any) -> bool:
    messages = tuple_.checkpoint.get("channel_values", {}).get("messages", [])
    last = messages[-1] if messages else None
    return getattr(last, "type", "") == "ai" and getattr(last, "content", "") == "done"


class Tooloop(System):
    """tooloop with its defaults: this process is the producer (submit, wait); the worker
    (turns and tools pools, every call sandboxed) and Redis are bench/peers.py's."""

    name = "tooloop"

    def __init__(self) -> None:
        from orchestrator import Client

        self.client = Client()

    def spec(self, model: str) -> dict:
        return {"prompt": USER, "steering": SYSTEM, "model": model, "tools": ["add"], "max_iterations": 50,
                "model_params": {"api_base": API_BASE, "api_key_env": "OPENAI_API_KEY"}}  # fmt: skip

    def run(self, model: str, run_id: str) -> None:
        self.check(self.client.submit(self.spec(model), run_id=run_id).wait(timeout=600))

    def batch(self, model: str, run_ids: list[str]) -> None:
        for handle in [self.client.submit(self.spec(model), run_id=run_id) for run_id in run_ids]:
            self.check(handle.wait(timeout=600))

    def start(self, model: str, run_id: str) -> None:
        self.client.submit(self.spec(model), run_id=run_id)

    @staticmethod
    def check(result: Any) -> None:
        assert result.status == "completed", (result.status, result.error)

    def finished(self, run_id: str, timeout: float) -> bool:
        try:
            return self.client.get(run_id).wait(timeout=timeout).status == "completed"
        except TimeoutError:
            return False

    def store_bytes(self) -> int:
        redis = self.client.store.redis
        prefix = self.client.store.keys.prefix
        keys = redis.scan_iter(f"{prefix}*", count=1000)
        return sum(redis.memory_usage(key, samples=0) or 0 for key in keys)

    def versions(self) -> dict[str, str]:
        import celery
        import redis

        server = self.client.store.redis.info("server").get("redis_version", "?")
        return {**super().versions(), "tooloop": version("tooloop"), "celery": celery.__version__,
                "redis-py": redis.__version__, "redis": server}  # fmt: skip


SYSTEMS = {cls.name: cls for cls in (InProcess, Dbos, LangGraph, Tooloop)}
