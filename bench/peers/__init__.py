"""The same agent on tooloop and on its durable peers, for ``bench/peers.py``.

Needs the optional extra ``peers`` (``pip install -e '.[peers]'``): DBOS Transact,
LangGraph with its Postgres checkpointer, langchain-litellm. Never imported by the
package or the test suite.

  loop.py       the agent every system runs: 10 tool-turns of ``add``, then an answer,
                the tool recording each execution (a line in effects.txt)
  tools.py      ``add`` as a tooloop tool (``TOOLOOP_TOOLS=bench.peers.tools``)
  systems.py    each system's way to run that agent: in-process, DBOS, LangGraph, tooloop
  driver.py     one system in a process of its own, driven over stdin/stdout
"""
