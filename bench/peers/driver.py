"""One system in a process of its own (its CPU and memory are measured, it is killed -9),
driven by bench/peers.py over stdin/stdout: one JSON command a line, one JSON reply a line.

    python -m bench.peers.driver SYSTEM
    {"op": "batch", "model": "openai/x", "run_ids": [...]}  -> {"ok": true, "wall_s": ...}
    {"op": "run" | "start" | "resume", "model": ..., "run_id": ...}
    {"op": "finished", "run_id": ..., "timeout": 60}        -> {"ok": true, "value": bool}
    {"op": "store_bytes"} | {"op": "versions"}
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> None:
    from bench.peers.systems import SYSTEMS

    out = sys.stdout
    sys.stdout = sys.stderr  # whatever a library prints stays off the protocol
    system = SYSTEMS[sys.argv[1]]()
    out.write(json.dumps({"ok": True, "ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        started = time.perf_counter()
        try:
            value = dispatch(system, command)
            reply = {"ok": True, "value": value, "wall_s": time.perf_counter() - started}
        except Exception as exc:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def dispatch(system, command: dict):
    op = command["op"]
    if op == "batch":
        return system.batch(command["model"], command["run_ids"])
    if op in ("run", "start", "resume"):
        return getattr(system, op)(command["model"], command["run_id"])
    if op == "finished":
        return system.finished(command["run_id"], command["timeout"])
    if op == "store_bytes":
        return system.store_bytes()
    if op == "versions":
        return system.versions()
    raise ValueError(op)


if __name__ == "__main__":
    main()
