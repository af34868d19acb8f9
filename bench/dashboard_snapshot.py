"""The dashboard, drawn from a real run: docs/img/dashboard.png.

Grafana is not installable offline here, so this renders deploy/grafana-dashboard.json's
panels itself, from real data: a `tooloop worker --metrics-port` and `tooloop api` serve a
few minutes of mixed traffic (tool calls, a failing tool, outcomes, runs that hit their
iteration cap, aborts) against the scripted model; a real Prometheus (Debian's `prometheus`
package) scrapes them every 2 s; each panel's PromQL, as written in the dashboard JSON
(with $__rate_interval = 30s), is then queried from that Prometheus over the whole window
and plotted with matplotlib at the panel's grid position. The queried series are kept in
docs/bench/dashboard_series.json.

    apt-get install prometheus; pip install matplotlib
    python bench/dashboard_snapshot.py [--minutes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, environment, scripted_model, scripted_spec

RATE_INTERVAL = "30s"


def add_turn(delay: float) -> dict:
    return {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}], "delay": delay, "tokens": 180}


def scripts(model_server) -> list[tuple[str, dict]]:
    """(model, extra spec fields) for each kind of run in the mix."""
    def script(steps: list[dict]) -> str:
        return model_server.script(steps)

    wc = {"tool_calls": [{"name": "word_count", "arguments": {"text": "a b c"}}], "delay": 0.4, "tokens": 90}
    bad = {"tool_calls": [{"name": "multiply", "arguments": {"a": "x"}}], "delay": 0.3, "tokens": 60}
    return [
        (script([add_turn(1.5), add_turn(1.0), {"content": "5", "delay": 1.0, "tokens": 240}]), {}),
        (script([wc, {"content": "3 words", "delay": 0.6, "tokens": 120}]), {}),
        (script([bad, {"content": "sorry", "delay": 0.5, "tokens": 80}]), {}),
        (script([add_turn(0.8), {"content": '{"outcome": "approved", "result": 5}', "delay": 0.8,
                                 "tokens": 150}]), {"outcome": {"enum": ["approved", "rejected"]}}),
        (script([add_turn(0.5)] * 3), {"max_iterations": 2}),
        (script([{"content": "slow", "delay": 4.0, "tokens": 300}]), {"abort_after": 1.0}),
        (script([add_turn(1.0), {"content": "resumed", "delay": 0.5, "tokens": 100}]), {"pause_for": 8.0}),
    ]


def drive(client, model_server, seconds: float) -> int:
    """Submit a mix of runs for ``seconds``, in waves that rise and fall."""
    kinds = scripts(model_server)
    started, submitted = time.monotonic(), 0
    rng = random.Random(7)
    aborts: list[threading.Timer] = []
    while (elapsed := time.monotonic() - started) < seconds:
        wave = 2 + int(6 * abs(((elapsed / 60) % 2) - 1))  # 2..8 runs every 2 s
        for _ in range(wave):
            model, fields = rng.choice(kinds)
            fields = dict(fields)
            abort_after = fields.pop("abort_after", None)
            pause_for = fields.pop("pause_for", None)
            handle = client.submit(scripted_spec(model_server, model, tools=["add", "word_count", "multiply"],
                                                 **fields))  # fmt: skip
            submitted += 1
            if abort_after:
                timer = threading.Timer(abort_after, handle.abort, kwargs={"reason": "demo abort"})
                timer.start()
                aborts.append(timer)
            if pause_for:  # paused during its first turn, resumed a few seconds later
                for delay, action in ((0.3, handle.pause), (pause_for, handle.resume)):
                    timer = threading.Timer(delay, action)
                    timer.start()
                    aborts.append(timer)
        time.sleep(2)
    for timer in aborts:
        timer.join()
    return submitted


def query_range(base: str, expr: str, start: float, end: float) -> list[dict]:
    import httpx

    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    reply = httpx.get(f"{base}/api/v1/query_range", params={"query": expr, "start": start, "end": end,
                                                             "step": "5s"}, timeout=30).json()  # fmt: skip
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def legend(template: str, labels: dict) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(dashboard: dict, series: dict[int, list], start: float, out: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    fig = plt.figure(figsize=(16, rows * 0.42 + 1.2), facecolor="#111217")
    fig.suptitle(f"{dashboard['title']} — {note}", color="#d8d9da", fontsize=11, x=0.01, ha="left")
    units = {"s": "seconds", "short": ""}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        box = [0.01 + g["x"] / 24 * 0.98 + 0.03, 1 - (g["y"] + g["h"]) / (rows + 2.5),
               g["w"] / 24 * 0.98 - 0.045, g["h"] / (rows + 2.5) - 0.045]
        ax = fig.add_axes(box, facecolor="#181b1f")
        ax.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        for lines in series[panel["id"]]:
            for name, points in lines:
                xs = [datetime.fromtimestamp(t) for t, _ in points]
                ax.plot(xs, [v for _, v in points], linewidth=1.6, label=name)
        ax.tick_params(colors="#9fa7b3", labelsize=7)
        ax.xaxis.set_major_locator(mdates.MinuteLocator())
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        ax.set_ylabel(units.get(panel["fieldConfig"]["defaults"]["unit"], ""), color="#9fa7b3", fontsize=7)
        ax.grid(color="#2c3235", linewidth=0.5)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        if not ax.lines:  # as Grafana shows a panel whose query returned nothing
            ax.text(0.5, 0.5, "No data", color="#9fa7b3", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left", facecolor="#181b1f", edgecolor="#2c3235",
                      labelcolor="#d8d9da")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, facecolor=fig.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=4)
    args = parser.parse_args()
    binary = shutil.which("prometheus")
    if binary is None:
        sys.exit("needs Prometheus: apt-get install prometheus")
    import httpx

    from orchestrator.local import WorkerProcess, free_port

    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        from orchestrator import Client

        model_server = scripted_model()
        stack.callback(model_server.stop)
        client = Client()
        worker_port, api_port, prom_port = free_port(), free_port(), free_port()
        worker = WorkerProcess("dash", "--metrics-port", str(worker_port), env=env)
        stack.callback(worker.stop)
        worker.wait_ready(client.store)
        api_env = {**os.environ, **env, "TOOLOOP_API_TOKENS": "t=demo"}
        api = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "api", "--port", str(api_port),
                                "-l", "warning"], env=api_env)  # fmt: skip
        stack.callback(api.terminate)
        folder = Path(tempfile.mkdtemp(prefix="tooloop-prom-"))
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "2s"},
            "scrape_configs": [
                {"job_name": "workers", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
                {"job_name": "api", "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}]},
            ]}))  # fmt: skip
        prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        stack.callback(prom.terminate)
        base = f"http://127.0.0.1:{prom_port}"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        start = time.time()
        runs = drive(client, model_server, args.minutes * 60)
        time.sleep(20)  # the last runs end, the last scrapes land
        end = time.time()
        series = {}
        for panel in dashboard["panels"]:
            series[panel["id"]] = []
            for target in panel["targets"]:
                result = query_range(base, target["expr"], start, end)
                series[panel["id"]].append([(legend(target["legendFormat"], r["metric"]),
                                             [(float(t), float(v)) for t, v in r["values"] if v != "NaN"])
                                            for r in result])  # fmt: skip
        data = {"start": start, "end": end, "series": series}
        (ROOT / "docs" / "bench" / "dashboard_series.json").write_text(json.dumps(data) + "\n")
        minutes = (end - start) / 60
        note = (f"{runs} runs over {minutes:.1f} min, one worker, scripted model; Prometheus data, "
                "rendered by bench/dashboard_snapshot.py")
        render(dashboard, series, start, ROOT / "docs" / "img" / "dashboard.png", note)
        print(f"{note}\nwritten to docs/img/dashboard.png")


if __name__ == "__main__":
    main()
