"""Record a run as a cassette and replay it offline (docs/replay.md).

- ``cassette``: the format (JSON lines) and what it may hold (no secret);
- ``record``: an ended run's cassette, from its journal, records and history;
- ``server``: the model a replay talks to, fed by the cassette;
- ``runner`` and ``tools``: the replay itself, the worker's turn and tool code in this
  process on an embedded Redis;
- ``report``: what it found (``orchestrator.testing`` is the users' entrance).
"""
