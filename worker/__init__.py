"""tooloop's data plane: the Celery app, turn and tool tasks, tools and their sandbox."""

from worker.registry import Tool, ToolDef, tool

__all__ = ["Tool", "ToolDef", "tool"]
