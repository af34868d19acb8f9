"""The agent as LangGraph's prebuilt ReAct agent over litellm (langchain-litellm)."""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_litellm import ChatLiteLLM
from langgraph.prebuilt import create_react_agent

from bench.peers.loop import SYSTEM, add_recorded


def build(model: str, api_base: str, folder: str, checkpointer: Any) -> Any:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return add_recorded(a, b, folder)

    chat = ChatLiteLLM(model=model, api_base=api_base, api_key="scripted")
    return create_react_agent(chat, [add], prompt=SYSTEM, checkpointer=checkpointer)
