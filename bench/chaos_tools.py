"""Tools of the chaos benchmark: a non-idempotent effect and an idempotent read."""

from __future__ import annotations

import os
import time

from worker import tool


@tool
def record_effect(text: str, seconds: float, sandbox_root: str) -> int:
    """Append `text` to effects.txt in the run's folder (not idempotent), then wait."""
    with open(os.path.join(sandbox_root, "effects.txt"), "a") as f:
        f.write(text + "\n")
    time.sleep(seconds)
    return 1


@tool(idempotent=True)
def read_value(key: str, seconds: float) -> str:
    """Idempotent: wait, then return the key upper-cased."""
    time.sleep(seconds)
    return key.upper()
