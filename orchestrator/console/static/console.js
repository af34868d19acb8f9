// The run console's one script: local times, live regions, the run's event stream, controls.
//
// Pages are rendered by the server (autoescaped). This script never builds markup from data:
// it swaps in elements of fragments the server rendered (matched by id), and appends streamed
// model text as text nodes. The Content-Security-Policy allows no other script.
"use strict";

(() => {
  const csrf = () => document.querySelector('meta[name="csrf-token"]')?.content || "";
  const served = new Map(); // element id -> the server's last HTML of it (unchanged: not swapped)

  // -- times, in the viewer's zone ----------------------------------------------------------
  function ago(date) {
    const s = Math.max(0, (Date.now() - date.getTime()) / 1000);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} d ago`;
  }

  function localTimes(root) {
    for (const el of root.querySelectorAll("time[datetime]")) {
      const date = new Date(el.getAttribute("datetime"));
      if (Number.isNaN(date.getTime())) continue;
      el.title = date.toLocaleString();
      el.textContent = el.hasAttribute("data-age") ? ago(date) : date.toLocaleString();
    }
  }

  // -- fragments ----------------------------------------------------------------------------
  async function fetchDoc(url) {
    const response = await fetch(url, { headers: { Accept: "text/html" }, credentials: "same-origin" });
    if (response.status === 401) {
      location.assign(`/login?next=${encodeURIComponent(location.pathname + location.search)}`);
      return null;
    }
    if (!response.ok) return null;
    return new DOMParser().parseFromString(await response.text(), "text/html");
  }

  // Put the server's fresh element in place of the one with its id (or after `after`).
  function place(fresh, after) {
    const html = fresh.outerHTML;
    const old = document.getElementById(fresh.id);
    if (old && served.get(fresh.id) === html) return old;
    const node = document.importNode(fresh, true);
    if (old) old.replaceWith(node);
    else if (after) after.after(node);
    else return null;
    served.set(fresh.id, html);
    localTimes(node);
    return node;
  }

  function remember(root) {
    for (const el of root.querySelectorAll("[id]")) served.set(el.id, el.outerHTML);
  }

  // -- polled regions (runs list, fleet) ----------------------------------------------------
  function poll(id) {
    const el = document.getElementById(id);
    const every = 1000 * (Number(el.dataset.pollS) || 3);
    const tick = async () => {
      const current = document.getElementById(id);
      if (!document.hidden && current) {
        const doc = await fetchDoc(current.dataset.poll).catch(() => null);
        const fresh = doc?.getElementById(id);
        if (fresh) place(fresh);
      }
      setTimeout(tick, every);
    };
    setTimeout(tick, every);
  }

  // -- a run's page -------------------------------------------------------------------------
  const TYPES = ["queued", "iteration", "tool_call", "approval", "control", "recovery", "compaction",
    "rate_limited", "discarded", "supervisor", "outcome"];

  function eventOrder(id) {
    const [ms, seq] = String(id).split("-").map(Number);
    return [ms || 0, seq || 0];
  }
  const newer = (a, b) => {
    const [x, y] = [eventOrder(a), eventOrder(b)];
    return x[0] > y[0] || (x[0] === y[0] && x[1] > y[1]);
  };

  function runPage(root) {
    const runId = root.dataset.runId;
    const base = `/runs/${encodeURIComponent(runId)}`;
    const texts = []; // streamed text seen: {id, iteration, text}
    let since = Infinity;
    let timer = null;
    let source = null;

    const lastTurn = () => {
      const turns = root.querySelectorAll("#timeline > article.turn");
      return turns.length ? Number(turns[turns.length - 1].dataset.iteration) : 0;
    };

    async function refresh() {
      const from = Number.isFinite(since) ? since : lastTurn();
      since = Infinity;
      timer = null;
      const doc = await fetchDoc(`${base}/partials/live?since=${Math.max(0, from)}`).catch(() => null);
      const live = doc?.getElementById("live");
      if (!live) return;
      place(live.querySelector("#header"));
      const controls = live.querySelector("#controls");
      if (controls.dataset.status !== document.getElementById("controls").dataset.status) place(controls);
      place(live.querySelector("#outcome"));
      const timeline = document.getElementById("timeline");
      let previous = null;
      for (const turn of live.querySelector("#turns").children) {
        const node = place(turn, previous) || timeline.appendChild(document.importNode(turn, true));
        if (!served.has(turn.id)) { served.set(turn.id, turn.outerHTML); localTimes(node); }
        previous = node;
      }
      replayText(live.dataset.lastEvent);
      if (live.dataset.live === "0") stop();
    }

    function schedule(iteration) {
      // no iteration (a pause, a steer): the turn it lands in is the last recorded one
      since = Math.min(since, Number.isInteger(iteration) ? iteration : Math.max(0, lastTurn() - 1));
      if (!timer) timer = setTimeout(refresh, 120);
    }

    function streamed(iteration) {
      return document.querySelector(`#turn-${iteration}.pending [data-testid="model-text"]`);
    }

    function replayText(renderedUpTo) {
      // text that arrived after the fragment was rendered goes back on top of it
      for (const piece of texts) {
        if (newer(piece.id, renderedUpTo)) streamed(piece.iteration)?.append(piece.text);
      }
    }

    function onText(event) {
      const data = JSON.parse(event.data);
      const iteration = Number(data.iteration);
      texts.push({ id: data.id, iteration, text: String(data.text ?? "") });
      const target = streamed(iteration);
      if (target) target.append(String(data.text ?? "")); // a text node: never parsed as markup
      else schedule(iteration);
    }

    function stop() {
      source?.close();
      source = null;
      root.dataset.live = "0";
      document.getElementById("live-indicator")?.remove();
    }

    function start() {
      source = new EventSource(`${base}/events?after=${encodeURIComponent(root.dataset.lastEvent || "0")}`);
      source.addEventListener("text", onText);
      for (const type of TYPES) {
        source.addEventListener(type, (event) => {
          const data = JSON.parse(event.data);
          schedule(data.iteration === undefined ? undefined : Number(data.iteration));
          if (type === "outcome") schedule(0);
        });
      }
    }

    root.refresh = () => schedule(undefined);
    if (root.dataset.live === "1") start();
  }

  // -- controls -----------------------------------------------------------------------------
  async function act(form) {
    const out = document.getElementById("action-result");
    const buttons = form.querySelectorAll("button");
    buttons.forEach((b) => { b.disabled = true; });
    try {
      const response = await fetch(form.action, {
        method: "POST",
        body: new URLSearchParams(new FormData(form)),
        headers: { "X-CSRF-Token": csrf(), Accept: "application/json" },
        credentials: "same-origin",
      });
      const data = await response.json().catch(() => ({}));
      if (out) {
        out.textContent = data.message || `${response.status} ${response.statusText}`;
        out.dataset.ok = String(response.ok);
      }
      if (response.ok && form.dataset.reset) form.reset();
      if (response.ok && data.location) location.assign(data.location); // a fork: its own page
      form.closest("dialog")?.close();
    } catch (error) {
      if (out) { out.textContent = `Not sent: ${error}`; out.dataset.ok = "false"; }
    } finally {
      buttons.forEach((b) => { b.disabled = false; });
      document.getElementById("run")?.refresh?.();
    }
  }

  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form.js-action");
    if (!form) return;
    event.preventDefault();
    act(form);
  });

  document.addEventListener("click", (event) => {
    const opener = event.target.closest("[data-opens]");
    if (opener) document.getElementById(opener.dataset.opens)?.showModal();
    const closer = event.target.closest("[data-closes]");
    if (closer) closer.closest("dialog")?.close();
  });

  document.addEventListener("DOMContentLoaded", () => {
    remember(document); // the server's HTML, before times are made local
    localTimes(document);
    for (const el of document.querySelectorAll("[data-poll]")) poll(el.id);
    const run = document.getElementById("run");
    if (run) runPage(run);
    setInterval(() => {
      for (const el of document.querySelectorAll("time[data-age]")) localTimes(el.parentElement);
    }, 15000);
  });
})();
