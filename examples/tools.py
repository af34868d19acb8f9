"""Example tools: `tooloop worker --tools examples.tools`."""

from __future__ import annotations

from worker import tool


@tool(idempotent=True)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(idempotent=True)
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool(idempotent=True)
def word_count(text: str) -> dict:
    """Count words and characters of a text.

    Args:
        text: the text to measure
    """
    return {"words": len(text.split()), "chars": len(text)}
