import time, cProfile, pstats
from tests.helpers import call, tools
def test_inspect(client, worker, spec, store, tmp_path):
    from orchestrator.replay.cassette import dumps
    from orchestrator.replay.record import record
    from orchestrator.testing import replay
    steps = [tools(call("add", {"a": i, "b": 3})) for i in range(19)] + [{"content": "five"}]
    h = client.submit(spec(steps, tools=["add"]))
    h.wait(timeout=120)
    p = tmp_path / "c.jsonl"
    p.write_text(dumps(record(store, h.run_id)))
    replay(p)
    for i in range(2):
        t = time.perf_counter(); r = replay(p); print("replay", time.perf_counter() - t, r.same, r.divergences)
    pr = cProfile.Profile(); pr.enable(); replay(p); pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
