// The evalbus dashboard: plain JavaScript, no build step. Every view reads the gateway's /v1 API
// (the session cookie authenticates it) and follows its event streams with EventSource.
"use strict";

const main = () => document.getElementById("main");
const streams = new Set(); // EventSources of the current page, closed when the page changes
const leaving = new Set(); // what else the current page holds (timers, a terminal), undone when it changes

// The page's CSP admits inline style only in <style> elements carrying this response's nonce.
// xterm.js's DOM renderer writes its theme and cell size into <style> elements it creates, so every
// <style> the page creates gets the nonce — at creation, since one set after insertion is ignored.
const STYLE_NONCE = document.currentScript?.nonce || "";
if (STYLE_NONCE) {
  const createElement = Document.prototype.createElement;
  Document.prototype.createElement = function createElementWithNonce(tag, options) {
    const node = createElement.call(this, tag, options);
    if (String(tag).toLowerCase() === "style") node.setAttribute("nonce", STYLE_NONCE);
    return node;
  };
}

// ------------------------------------------------------------------ helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "style") node.style.cssText = value; // through the CSSOM: the CSP refuses style attributes
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function show(...nodes) {
  const root = main();
  root.replaceChildren(...nodes.filter((node) => node !== null && node !== undefined && node !== false));
}

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const init = { credentials: "same-origin", headers: { Accept: "application/json" }, ...options };
  if (init.method && init.method !== "GET") init.headers = { ...init.headers, "X-Evalbus-Csrf": "1" };
  if (init.json !== undefined) {
    init.body = JSON.stringify(init.json);
    init.headers["Content-Type"] = "application/json";
    delete init.json;
  }
  const response = await fetch(path, init);
  if (response.status === 401) throw new Unauthorized();
  const body = response.headers.get("Content-Type")?.includes("json") ? await response.json() : null;
  if (!response.ok) {
    const error = new Error(body?.error?.message || `${response.status}`);
    error.status = response.status;
    error.field = body?.error?.field;
    throw error;
  }
  return body;
}

function when(value) {
  // times in the reader's time zone
  return value ? new Date(value).toLocaleString() : "–";
}

function seconds(from, to) {
  if (!from || !to) return "–";
  const s = (new Date(to) - new Date(from)) / 1000;
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function fmt(value, percent) {
  if (value === null || value === undefined) return "–";
  return percent ? `${(value * 100).toFixed(1)}%` : Number(value).toPrecision(3);
}

function badge(text, kind) {
  return el("span", { class: `badge ${kind || text || ""}`, "data-badge": text || "" }, text || "–");
}

function follow(path, handlers) {
  const source = new EventSource(path, { withCredentials: true });
  streams.add(source);
  for (const [name, handler] of Object.entries(handlers)) {
    source.addEventListener(name, (message) => {
      let data = message.data;
      try { data = JSON.parse(message.data); } catch (_) { /* a plain frame */ }
      handler(data, message);
    });
  }
  source.addEventListener("end", () => { source.close(); streams.delete(source); });
  return source;
}

function closeStreams() {
  for (const source of streams) source.close();
  streams.clear();
  for (const undo of leaving) {
    try { undo(); } catch (_) { /* the page is going away anyway */ }
  }
  leaving.clear();
}

function pause(ms) {
  // a wait the page can cut short: leaving the page resolves it at once
  return new Promise((resolve) => {
    const done = () => { clearTimeout(timer); leaving.delete(done); resolve(); };
    const timer = setTimeout(done, ms);
    leaving.add(done);
  });
}

function failed(error) {
  if (error instanceof Unauthorized) return loginView();
  show(el("p", { class: "error", "data-testid": "error" }, `Something went wrong: ${error.message}`));
}

// ------------------------------------------------------------------ login

function loginView(message) {
  closeStreams();
  document.getElementById("who").replaceChildren();
  const input = el("input", { type: "password", name: "token", autocomplete: "current-password", "data-testid": "token" });
  const note = el("p", { class: "error", "data-testid": "login-error" }, message || "");
  const form = el(
    "form",
    {
      class: "login",
      onsubmit: async (event) => {
        event.preventDefault();
        try {
          await api("/ui/login", { method: "POST", json: { token: input.value } });
          input.value = "";
          await whoAmI();
          if (!location.hash || location.hash === "#/login") location.hash = "#/batches";
          else route();
        } catch (error) {
          note.textContent = error instanceof Unauthorized ? "Unknown token." : error.message;
        }
      },
    },
    el("h1", {}, "Log in to evalbus"),
    el("p", { class: "sub" }, "Paste your evalbus token (the admin token is in .evalbus/token)."),
    input,
    el("button", { type: "submit", "data-testid": "login" }, "Log in"),
    note,
  );
  show(form);
  input.focus();
}

async function whoAmI() {
  const me = await api("/v1/me");
  const logout = el("button", {
    "data-testid": "logout",
    onclick: async () => { await api("/ui/logout", { method: "POST" }); loginView("Logged out."); },
  }, "Log out");
  document.getElementById("who").replaceChildren(`${me.principal} (${me.role})`, logout);
  return me;
}

// ------------------------------------------------------------------ batches

const STAGES = ["requested", "executed", "judged", "exported"];

function progress(counts, total) {
  return el("div", { class: "progress" }, STAGES.map((stage) => {
    const n = counts?.[stage] || 0;
    const share = total ? Math.min(100, (100 * n) / total) : 0;
    return el("div", { class: `stage ${total && n >= total ? "done" : ""}`, "data-stage": stage },
      el("small", {}, `${stage} `), el("span", { "data-count": stage }, `${n}/${total ?? "?"}`),
      el("div", { class: "bar" }, el("i", { style: `width:${share}%` })));
  }));
}

async function batchesView() {
  const page = await api("/v1/batches?limit=50");
  const rows = page.batches || [];
  if (!rows.length) {
    return show(el("h1", {}, "Batches"),
      el("p", { class: "empty", "data-testid": "empty" }, "No batch yet. Submit one with: evalbus run examples/suite.yaml"));
  }
  const body = el("tbody");
  for (const batch of rows) {
    const cell = el("td", {}, progress(batch.counts, batch.total_runs));
    const status = el("td", {}, badge(batch.status));
    body.append(el("tr", { "data-batch": batch.batch_id },
      el("td", {}, el("a", { href: `#/batch/${encodeURIComponent(batch.batch_id)}` }, batch.batch_id)),
      el("td", {}, batch.suite_id || "–"), status, cell,
      el("td", {}, batch.submitted_by || "–"), el("td", {}, when(batch.created_at))));
    if (!batch.finalized_at) {
      // the stream replays the batch from its first event: count its runs per stage from it (the
      // store's counts, read a moment ago, stand until the replay passes them)
      const runs = Object.fromEntries(STAGES.map((stage) => [stage, new Set()]));
      follow(`/v1/batches/${encodeURIComponent(batch.batch_id)}/events`, Object.fromEntries([
        ...STAGES.map((stage) => [`case.${stage}`, (event) => {
          runs[stage].add(event.run_id);
          const counts = Object.fromEntries(STAGES.map((s) => [s, Math.max(batch.counts?.[s] || 0, runs[s].size)]));
          cell.replaceChildren(progress(counts, batch.total_runs));
          cell.dataset.events = String(Number(cell.dataset.events || 0) + 1); // stage events heard (for tests)
        }]),
        ["batch.finalized", (event) => status.replaceChildren(badge(event.status))],
      ]));
    }
  }
  show(el("h1", {}, "Batches"), el("p", { class: "sub" }, "Newest first; progress updates live."),
    el("table", { "data-testid": "batches" },
      el("thead", {}, el("tr", {}, ["batch", "suite", "status", "progress", "by", "submitted"].map((h) => el("th", {}, h)))),
      body));
}

function scoreText(scores) {
  return (scores || []).filter((s) => s.status === "measured")
    .map((s) => `${s.metric} ${fmt(s.value)}${s.pass === true ? " ✓" : s.pass === false ? " ✗" : ""}`).join(" · ");
}

const STAGE_RANK = { requested: 1, executed: 2, collected: 3, judged: 4, exported: 5 };
// how far a run has come, by its recorded stage (the batch page reads a row again until it is there)

async function batchView(batchId) {
  const id = encodeURIComponent(batchId);
  const batch = await api(`/v1/batches/${id}`);
  const runs = [];
  let cursor = null;
  do {
    const page = await api(`/v1/batches/${id}/cases?limit=1000${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`);
    runs.push(...(page.cases || []));
    cursor = page.next_cursor;
  } while (cursor);
  const rows = new Map();
  const body = el("tbody");
  const head = el("div", {});
  const summary = el("div", { "data-testid": "summary" });

  function renderHead(view) {
    const cancel = view.finalized_at ? null : el("button", {
      class: "danger", "data-testid": "cancel",
      onclick: async () => { await api(`/v1/batches/${id}/cancel`, { method: "POST", json: {} }); },
    }, "Cancel");
    head.replaceChildren(
      el("h1", {}, `Batch ${view.batch_id} `, badge(view.status)),
      el("p", { class: "sub" }, `suite ${view.suite_id || "–"} · ${view.total_runs ?? "?"} runs · by ${view.submitted_by || "–"} · submitted ${when(view.created_at)}`),
      progress(view.counts, view.total_runs), ...(cancel ? [cancel] : []),
      view.finalized_at ? decide(view) : null);
  }

  function decide(view) {
    // what to compare it with: its suite's baseline (which it may become) or any other batch
    const link = el("a", { href: `#/compare?candidate=${id}`, "data-testid": "compare-link" }, "Compare with another batch or the suite's baseline");
    const baseline = el("span", { class: "sub", "data-testid": "baseline" });
    const line = el("div", { class: "actions" }, link, baseline);
    if (!view.suite_id) return line;
    const suite = encodeURIComponent(view.suite_id);
    const render = (current) => {
      if (current?.batch_id === view.batch_id) {
        return baseline.replaceChildren(badge("baseline"), ` of suite ${view.suite_id}, set by ${current.set_by} ${when(current.set_at)}`);
      }
      const make = view.status === "succeeded" ? el("button", {
        "data-testid": "make-baseline",
        onclick: async () => {
          try { render(await api(`/v1/suites/${suite}/baseline`, { method: "PUT", json: { batch_id: view.batch_id } })); } catch (error) { baseline.replaceChildren(el("span", { class: "error" }, error.message)); }
        },
      }, "Make it the suite's baseline") : null;
      baseline.replaceChildren(current ? `the suite's baseline is ${current.batch_id} ` : "the suite has no baseline ", make || "");
    };
    api(`/v1/suites/${suite}/baseline`).then(render, (error) => {
      if (error.status === 404) render(null); // none set yet
      else baseline.replaceChildren(); // unknown: say nothing rather than something wrong
    });
    return line;
  }

  function renderRow(run) {
    const tr = el("tr", { "data-case": run.case_id, "data-run": run.run_id, "data-verdict": run.verdict || "" },
      el("td", {}, el("a", { href: `#/run/${encodeURIComponent(run.run_id)}` }, run.case_id), run.trial ? ` (trial ${run.trial})` : ""),
      el("td", {}, badge(run.stage)),
      el("td", {}, badge(run.executed_status || "–", run.executed_status)),
      el("td", { "data-testid": "verdict" }, badge(run.verdict || "–", run.verdict)),
      el("td", {}, scoreText(run.scores)),
      el("td", { class: "num" }, seconds(run.requested_at, run.exported_at || run.executed_at)));
    const old = rows.get(run.run_id);
    if (old) old.replaceWith(tr); else body.append(tr);
    rows.set(run.run_id, tr);
  }

  function renderSummary(view) {
    if (!view.summary) {
      summary.replaceChildren(el("p", { class: "empty" }, "The summary appears when every case is exported."));
      return;
    }
    const metrics = view.summary.metrics || [];
    const v = view.summary.verdicts || {};
    summary.replaceChildren(
      el("h2", {}, "Summary"),
      el("p", {}, `verdicts: ${v.passed || 0} passed, ${v.failed || 0} failed, ${v.no_verdict || 0} without a verdict (pass rate ${fmt(v.pass_rate, true)})`),
      el("div", { class: "grid2" },
        el("table", {},
          el("thead", {}, el("tr", {}, ["metric", "count", "mean", "pass rate", "unmeasured"].map((h) => el("th", {}, h)))),
          el("tbody", {}, metrics.map((m) => el("tr", {},
            el("td", {}, m.metric), el("td", { class: "num" }, m.count), el("td", { class: "num" }, fmt(m.mean)),
            el("td", { class: "num" }, fmt(m.pass_rate, true)),
            el("td", {}, Object.entries(m.unmeasured || {}).map(([k, n]) => `${k} ${n}`).join(", ")))))),
        barChart(metrics.filter((m) => m.pass_rate !== null && m.pass_rate !== undefined)
          .map((m) => [m.metric, m.pass_rate]), "pass rate by metric")));
  }

  renderHead(batch);
  for (const run of runs) renderRow(run);
  renderSummary(batch);
  show(head,
    el("h2", {}, "Cases"),
    el("table", { "data-testid": "cases" },
      el("thead", {}, el("tr", {}, ["case", "stage", "execution", "verdict", "scores", "duration"].map((h) => el("th", {}, h)))),
      body),
    summary);

  if (batch.finalized_at) return;
  // A stage event comes from the stream, the row from the event store, which records it a moment
  // later (seconds, when the recorder is busy): a row read too early is read again, with a growing
  // pause, until it shows at least the stage the stream announced.
  const seen = new Map(); // run id -> furthest stage the stream announced
  const pending = new Map();
  const refresh = async (runId, attempt) => {
    let run = null;
    try { run = await api(`/v1/runs/${encodeURIComponent(runId)}`); } catch (_) { /* not recorded yet */ }
    if (run) renderRow(run);
    const behind = !run || (STAGE_RANK[run.stage] ?? 0) < (STAGE_RANK[seen.get(runId)] ?? 0);
    if (behind && attempt < 40) soon(runId, attempt + 1);
  };
  const soon = (runId, attempt = 0) => {
    clearTimeout(pending.get(runId));
    pending.set(runId, setTimeout(() => refresh(runId, attempt), Math.min(2000, 150 * 1.5 ** attempt)));
  };
  const announced = (stage) => (e) => {
    if ((STAGE_RANK[stage] ?? 0) > (STAGE_RANK[seen.get(e.run_id)] ?? 0)) seen.set(e.run_id, stage);
    soon(e.run_id);
  };
  follow(`/v1/batches/${id}/events`, {
    "case.requested": announced("requested"),
    "case.executed": announced("executed"),
    "case.collected": announced("collected"),
    "case.judged": announced("judged"),
    "case.exported": announced("exported"),
    "batch.finalized": async () => {
      for (const runId of rows.keys()) soon(runId);
      let view = await api(`/v1/batches/${id}`);
      for (let i = 0; i < 20 && !view.summary; i += 1) {
        await new Promise((resolve) => setTimeout(resolve, 250));
        view = await api(`/v1/batches/${id}`);
      }
      renderHead(view);
      renderSummary(view);
    },
  });
}

function barChart(pairs, title) {
  const width = 420, row = 22, left = 150, height = 30 + row * pairs.length;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", title);
  const text = (x, y, value, anchor) => {
    const t = document.createElementNS(svg.namespaceURI, "text");
    t.setAttribute("x", x); t.setAttribute("y", y);
    if (anchor) t.setAttribute("text-anchor", anchor);
    t.textContent = value;
    svg.append(t);
  };
  text(8, 16, title);
  pairs.forEach(([label, value], i) => {
    const y = 26 + i * row;
    text(left - 6, y + 12, label, "end");
    const bar = document.createElementNS(svg.namespaceURI, "rect");
    bar.setAttribute("x", left); bar.setAttribute("y", y);
    bar.setAttribute("height", row - 6);
    bar.setAttribute("width", Math.max(1, (width - left - 60) * value));
    bar.setAttribute("fill", value >= 0.8 ? "#1f8f4e" : value >= 0.5 ? "#b7791f" : "#c0392b");
    svg.append(bar);
    text(left + (width - left - 60) * value + 6, y + 12, fmt(value, true));
  });
  return svg;
}

function lineChart(points, title) {
  // one line per metric: the pass rate (else the mean) per hour over the last 24 hours
  const width = 560, height = 200, left = 40, right = 110, top = 24, bottom = 28;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", title);
  const node = (tag, attrs, text) => {
    const n = document.createElementNS(svg.namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
    return n;
  };
  node("text", { x: 8, y: 16 }, title);
  const end = Date.now(), start = end - 24 * 3600 * 1000;
  const x = (t) => left + ((t - start) / (end - start)) * (width - left - right);
  const y = (v) => top + (1 - v) * (height - top - bottom);
  node("line", { x1: left, y1: y(0), x2: width - right, y2: y(0), stroke: "#e2e5ec" });
  node("line", { x1: left, y1: y(1), x2: width - right, y2: y(1), stroke: "#e2e5ec" });
  node("text", { x: left - 6, y: y(1) + 4, "text-anchor": "end" }, "100%");
  node("text", { x: left - 6, y: y(0) + 4, "text-anchor": "end" }, "0%");
  node("text", { x: left, y: height - 8 }, new Date(start).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }));
  node("text", { x: width - right, y: height - 8, "text-anchor": "end" }, "now");
  const colors = ["#2f6fd6", "#1f8f4e", "#b7791f", "#c0392b", "#6b3fa0"];
  const byMetric = new Map();
  for (const p of points) {
    const value = p.pass_rate ?? (p.mean !== null && p.mean >= 0 && p.mean <= 1 ? p.mean : null);
    if (value === null) continue;
    if (!byMetric.has(p.metric)) byMetric.set(p.metric, []);
    byMetric.get(p.metric).push([new Date(p.hour).getTime() + 30 * 60 * 1000, value]);
  }
  [...byMetric.entries()].forEach(([metric, pts], i) => {
    const color = colors[i % colors.length];
    pts.sort((a, b) => a[0] - b[0]);
    node("polyline", { points: pts.map(([t, v]) => `${x(t)},${y(v)}`).join(" "), fill: "none", stroke: color, "stroke-width": 2 });
    for (const [t, v] of pts) node("circle", { cx: x(t), cy: y(v), r: 3, fill: color });
    node("text", { x: width - right + 8, y: top + 14 * i + 10, fill: color }, metric);
  });
  return svg;
}

// ------------------------------------------------------------------ a run

function describe(event) {
  switch (event.kind) {
    case "message": return `${event.role}: ${event.text}`;
    case "llm_call": return `${event.model}${event.input_tokens != null ? ` · ${event.input_tokens} in / ${event.output_tokens ?? "?"} out tokens` : ""}${event.cost_usd != null ? ` · $${event.cost_usd}` : ""}`;
    case "tool_call": return `${event.name}(${JSON.stringify(event.args || {})})`;
    case "tool_result": return `${event.ok === false ? "failed: " : ""}${event.output ?? ""}`;
    case "infra": return `${event.event}: ${event.message || ""}${event.node ? ` (${event.node})` : ""}`;
    case "error": return event.message || "";
    case "log": return event.text || event.message || "";
    default: return event.name || JSON.stringify(event);
  }
}

function timeline(list, events) {
  // the same component renders the live trace and, once the run sealed, its recorded trace
  for (const event of events) {
    list.append(el("li", { "data-kind": event.kind },
      el("span", { class: "t" }, `${Number(event.t || 0).toFixed(2)} s`),
      el("span", { class: `kind ${event.kind}` }, event.kind.replace("_", " ")),
      el("span", { class: "body" }, describe(event))));
  }
}

function sealedTrace(trajectory) {
  // the furthest stage's result holds the whole trace (executed < collected < judged)
  let best = [];
  for (const stored of trajectory.events || []) {
    const trace = stored.body?.result?.trace;
    if (Array.isArray(trace) && trace.length >= best.length) best = trace;
  }
  return best;
}

// ------------------------------------------------------------------ a run's screen and terminal

const SCREEN_EVERY_MS = 2000;

function screenWidget(runId, live) {
  // a frame of the browser the run's harness drives, taken again every 2 s while the run is live
  const id = encodeURIComponent(runId);
  const state = el("p", { class: "sub screen-state", "data-testid": "screen-state", "data-state": "loading" }, "Looking for a screen…");
  const image = el("img", { class: "screen", "data-testid": "screen", alt: `the screen of ${runId}`, hidden: true });
  const node = el("div", {}, state, image);
  let active = true, shown = false, why = "";
  const stop = () => { active = false; };
  leaving.add(stop);

  function note(kind, text) {
    state.dataset.state = kind;
    state.textContent = text;
  }

  async function capture() {
    let shot;
    try {
      shot = await api(`/v1/runs/${id}/screen`);
    } catch (error) {
      if (error instanceof Unauthorized) throw error;
      if (error.status === 403) { stop(); return note("forbidden", "Only the run's creator or an admin can see its screen."); }
      return note("error", `The screen could not be read: ${error.message}`);
    }
    if (!active) return;
    if (shot.supported && shot.found && shot.data_url) {
      if (image.getAttribute("src") !== shot.data_url) image.src = shot.data_url;
      image.hidden = false;
      shown = true;
      return note("live", `Live screen${shot.target ? ` of ${shot.target}` : ""} · taken ${new Date().toLocaleTimeString()}`);
    }
    why = shot.reason || "nothing to capture";
    if (shown) return note("ended", `The last frame taken (now: ${why}).`);
    return note("none", `No screen for this run: ${why}.`);
  }

  (async () => {
    do {
      // a tab nobody looks at takes no frames (each is a capture in the sandbox's browser)
      if (!document.hidden || !shown) await capture().catch(() => stop());
      if (!live()) break;
      await pause(SCREEN_EVERY_MS);
    } while (active && live());
    if (!active) return;
    if (shown) note("ended", "The run has settled: this is the last frame taken.");
    else if (state.dataset.state === "loading") note("none", "No screen for this run.");
  })();
  return node;
}

let xtermLoading = null;
function loadXterm() {
  // xterm.js (vendored, see assets/vendor/xterm/README.md) is loaded when a shell is first opened
  if (window.Terminal && window.FitAddon) return Promise.resolve();
  if (xtermLoading) return xtermLoading;
  const load = (tag, attrs) => new Promise((resolve, reject) => {
    const node = el(tag, attrs);
    node.addEventListener("load", resolve);
    node.addEventListener("error", () => reject(new Error(`could not load ${attrs.src || attrs.href}`)));
    document.head.append(node);
  });
  xtermLoading = Promise.all([
    load("link", { rel: "stylesheet", href: "/ui/assets/xterm.css" }),
    load("script", { src: "/ui/assets/xterm.js" }).then(() => load("script", { src: "/ui/assets/addon-fit.js" })),
  ]).catch((error) => { xtermLoading = null; throw error; });
  return xtermLoading;
}

const CLOSE_REASONS = {
  1000: "the shell exited",
  1001: "the gateway is stopping",
  1006: "the connection was lost",
  1011: "the dispatcher holding the run stopped answering",
  4404: "no live sandbox holds the run",
  4410: "the run's sandbox was released",
};

function terminalWidget(runId, live) {
  // one persistent shell in the run's sandbox, opened only when the reader asks (never one per viewer)
  const id = encodeURIComponent(runId);
  const state = el("p", { class: "sub", "data-testid": "terminal-state", "data-state": "idle" });
  const screen = el("div", { class: "terminal", "data-testid": "terminal", hidden: true });
  // Pressing these leaves the focus in the terminal: xterm.js clears its input element on blur, and
  // the page was seen to scroll between the press and the release, so the click was lost.
  const keepFocus = (event) => event.preventDefault();
  const open = el("button", { "data-testid": "open-shell", onmousedown: keepFocus, onclick: () => start() }, "Open a shell");
  const close = el("button", {
    "data-testid": "close-shell", hidden: true, onmousedown: keepFocus, onclick: () => end("the reader closed it"),
  }, "Close the shell");
  const node = el("div", {}, el("div", { class: "actions" }, open, close, state), screen);
  let session = null;
  let shown = null; // the last terminal drawn: kept on screen after its shell ended, replaced by the next

  function note(kind, text) {
    state.dataset.state = kind;
    state.textContent = text;
  }

  function idle() {
    if (live()) {
      open.hidden = false;
      note("idle", "A persistent shell in the run's sandbox (its workdir and environment), for the run's creator or an admin.");
    } else {
      open.hidden = true;
      // a shell that ended keeps saying why; otherwise say why there is none to open
      if (!session && state.dataset.state !== "closed") note("settled", "The run has settled: its sandbox is gone, so there is no shell to open.");
    }
  }

  function end(text) {
    if (!session) return;
    const { term, socket, observer } = session;
    session = null;
    close.hidden = true;
    observer.disconnect();
    term.options.disableStdin = true;
    term.options.cursorBlink = false;
    if (socket.readyState <= WebSocket.OPEN) socket.close(1000, "the reader closed the terminal");
    note("closed", `Shell ended: ${text}.`);
    open.textContent = "Open a new shell";
    open.hidden = !live();
  }

  async function start() {
    open.hidden = true;
    note("connecting", "Opening a shell…");
    try {
      await loadXterm();
    } catch (error) {
      open.hidden = false;
      return note("error", `The terminal could not load: ${error.message}`);
    }
    let ticket;
    try {
      ticket = await api(`/v1/runs/${id}/terminal-ticket`, { method: "POST", json: {} });
    } catch (error) {
      if (error instanceof Unauthorized) return failed(error);
      open.hidden = !live();
      if (error.status === 403) return note("forbidden", "Only the run's creator or an admin can open a shell in its sandbox.");
      return note("error", `No shell: ${error.message}`);
    }
    screen.hidden = false;
    shown?.dispose();
    screen.replaceChildren();
    const term = new window.Terminal({
      cursorBlink: true, fontSize: 13, scrollback: 2000, convertEol: false,
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      theme: { background: "#10141c", foreground: "#d9dee8" },
    });
    shown = term;
    const fit = new window.FitAddon.FitAddon();
    term.loadAddon(fit);
    term.open(screen);
    fit.fit();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}${ticket.url}&cols=${term.cols}&rows=${term.rows}`);
    socket.binaryType = "arraybuffer";
    const early = []; // keystrokes typed before the socket opened (the gateway buffers them from there on)
    const send = (frame) => {
      const text = JSON.stringify(frame);
      if (socket.readyState === WebSocket.OPEN) socket.send(text); else if (socket.readyState === WebSocket.CONNECTING) early.push(text);
    };
    const observer = new ResizeObserver(() => { if (session) fit.fit(); });
    observer.observe(screen);
    session = { term, socket, observer };
    const mine = session;
    term.onData((data) => send({ type: "input", data }));
    const size = () => { screen.dataset.cols = term.cols; screen.dataset.rows = term.rows; };
    size();
    term.onResize(({ cols, rows }) => { size(); send({ type: "resize", cols, rows }); });
    let closing = null;
    socket.addEventListener("open", () => { for (const text of early.splice(0)) socket.send(text); });
    socket.addEventListener("message", (message) => {
      if (typeof message.data !== "string") return term.write(new Uint8Array(message.data));
      let frame = {};
      try { frame = JSON.parse(message.data); } catch (_) { return; }
      if (frame.type === "attached") {
        note("attached", `Connected: ${frame.shell || "a shell"} in the run's sandbox.`);
        close.hidden = false;
        term.focus();
      } else if (frame.type === "closed") {
        closing = frame.exit_code !== null && frame.exit_code !== undefined ? `${frame.reason} (exit code ${frame.exit_code})` : frame.reason;
      }
    });
    socket.addEventListener("close", (event) => {
      if (session !== mine) return;
      end(closing || event.reason || CLOSE_REASONS[event.code] || `the connection closed (${event.code})`);
    });
    leaving.add(() => { if (session === mine) end("the reader left the page"); if (shown === term) term.dispose(); });
  }

  idle();
  return { node, settled: () => { if (!session) idle(); else open.hidden = true; } };
}

const RUN_EVERY_MS = 2000;

function phaseBadge(view) {
  // where the run is: its placement while it has not settled, then its furthest stage (the API's `phase`)
  const phase = view.phase || view.stage;
  const node = badge(phase);
  node.dataset.testid = "run-phase";
  node.title = `stage recorded: ${view.stage}`;
  return node;
}

async function runView(runId) {
  const id = encodeURIComponent(runId);
  const run = await api(`/v1/runs/${id}`).catch((error) => (error.status === 404 ? null : Promise.reject(error)));
  const title = el("h1", {}, `Run ${runId}`);
  const facts = el("dl", { class: "kv", "data-testid": "run-facts" });
  const log = el("pre", { class: "log", "data-testid": "log" });
  const trace = el("ol", { class: "timeline", "data-testid": "trace" });
  const traceNote = el("p", { class: "sub", "data-testid": "trace-state" }, "Live trace");
  const placement = el("div", { "data-testid": "placement" });
  // live while its sandbox may hold it: not executed yet (the sandbox is released before that is recorded)
  let settled = Boolean(run?.executed_at);
  const live = () => !settled;
  const shell = terminalWidget(runId, live);

  function renderFacts(view) {
    const rows = view ? [
      ["case", view.case_id], ["batch", view.batch_id ? el("a", { href: `#/batch/${encodeURIComponent(view.batch_id)}` }, view.batch_id) : "–"],
      ["phase", phaseBadge(view)], ["execution", badge(view.executed_status || "–", view.executed_status)],
      ["verdict", badge(view.verdict || "–", view.verdict)], ["answer", view.answer ?? "–"],
      ["scores", scoreText(view.scores) || "–"], ["requested", when(view.requested_at)], ["executed", when(view.executed_at)],
      ["failure", view.failure ? `${view.failure.failure_class}: ${view.failure.message}` : "–"],
      ["live trace", view.live_trace ? `${view.live_trace.kind} at ${view.live_trace.endpoint}` : "–"],
    ] : [["state", "not recorded yet (it may be starting)"]];
    facts.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  }

  renderFacts(run);
  show(title, facts,
    el("div", { class: "grid2" },
      el("section", {}, el("h2", {}, "Log"), log),
      el("section", {}, el("h2", {}, "Trace"), traceNote, trace)),
    el("div", { class: "grid2" },
      el("section", {}, el("h2", {}, "Screen"), screenWidget(runId, live)),
      el("section", {}, el("h2", {}, "Terminal"), shell.node)),
    el("h2", {}, "Placement"), placement);

  const renderPlacement = () => api(`/v1/runs/${id}/placement`).then((p) => {
    placement.replaceChildren(el("dl", { class: "kv" },
      ...Object.entries(p).filter(([, v]) => typeof v !== "object").flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])));
  }).catch(() => placement.replaceChildren(el("p", { class: "empty" }, "No placement to show.")));
  renderPlacement();

  (async () => {
    // the phase and the placement follow the run while it is live (each read projects the LIVE stream)
    let active = true;
    leaving.add(() => { active = false; });
    while (active && live()) {
      await pause(RUN_EVERY_MS);
      if (!active || !live()) break;
      const view = await api(`/v1/runs/${id}`).catch(() => null);
      if (!active || !live()) break; // the end handler renders the settled run
      if (view) renderFacts(view);
      await renderPlacement();
    }
  })();

  follow(`/v1/runs/${id}/logs/stream`, {
    log: (chunk) => {
      const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      if (chunk.stream === "recorded") {
        // a settled run whose live output has left the stream: the end of it, from the event store
        log.append(el("span", { class: "muted", "data-testid": "log-recorded" }, "(the end of the output, as recorded)\n"));
      }
      log.append(el("span", { class: chunk.stream }, chunk.text));
      if (atEnd) log.scrollTop = log.scrollHeight;
    },
  });
  const liveTrace = follow(`/v1/runs/${id}/trajectory/live/stream`, { trace: (event) => timeline(trace, [event]) });
  liveTrace.addEventListener("end", async () => {
    settled = true;
    shell.settled();
    renderPlacement();
    renderFacts(await api(`/v1/runs/${id}`).catch(() => run));
    // the sealed record replaces the live view once it is there
    for (let i = 0; i < 40; i += 1) {
      const trajectory = await api(`/v1/runs/${id}/trajectory`).catch(() => null);
      const events = trajectory ? sealedTrace(trajectory) : [];
      if (trajectory?.seal || events.length) {
        trace.replaceChildren();
        timeline(trace, events);
        traceNote.textContent = trajectory.seal ? `Sealed trajectory (head ${trajectory.seal.head_hash.slice(0, 12)}…)` : "Recorded trace";
        if (trajectory.seal) {
          // sealed: every stage is recorded, so the read model has the verdict and every score
          renderFacts(await api(`/v1/runs/${id}`).catch(() => run));
          return;
        }
      }
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
  });
  if (!log.childNodes.length) log.append(el("span", { class: "muted" }, ""));
}

// ------------------------------------------------------------------ compare

const BUCKETS = [
  ["regressed", "Regressed cases", "the candidate's verdicts pass less often than the base's"],
  ["improved", "Improved cases", "the candidate's verdicts pass more often"],
  ["no_verdict", "Cases without a verdict on one side", "an infrastructure failure leaves a run without a verdict"],
  ["only_in_base", "Only in the base", ""],
  ["only_in_candidate", "Only in the candidate", ""],
];

function signed(value, percent) {
  if (value === null || value === undefined) return "–";
  const text = percent ? `${(value * 100).toFixed(1)} pp` : Number(value).toPrecision(3);
  return value > 0 ? `+${text}` : text.replace("-", "−");
}

function pValue(value) {
  if (value === null || value === undefined) return "–";
  return value < 0.001 ? value.toExponential(1) : value.toFixed(3);
}

function batchOption(batch, selected) {
  const label = `${batch.batch_id} · ${batch.suite_id || "–"} · ${batch.status} · ${when(batch.finalized_at || batch.created_at)}`;
  return el("option", { value: batch.batch_id, selected: batch.batch_id === selected }, label);
}

function intervalChart(metrics) {
  // the delta of every rate with its 95 % interval, on one scale from −100 to +100 points
  const rates = metrics.filter((m) => m.statistic === "pass_rate" && m.delta !== null && m.delta !== undefined);
  const width = 460, row = 24, left = 140, right = 20, top = 26, height = top + row * rates.length + 22;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  const node = (tag, attrs, text) => {
    const n = document.createElementNS(svg.namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
    return n;
  };
  for (const [k, v] of Object.entries({ class: "chart", width, height, role: "img", "aria-label": "rate deltas with 95% intervals" })) svg.setAttribute(k, v);
  const x = (v) => left + ((Math.max(-1, Math.min(1, v)) + 1) / 2) * (width - left - right);
  node("text", { x: 8, y: 16 }, "candidate − base, 95 % interval");
  node("line", { x1: x(0), y1: top - 4, x2: x(0), y2: height - 18, stroke: "#6b7385", "stroke-dasharray": "3 3" });
  for (const v of [-1, 0, 1]) node("text", { x: x(v), y: height - 4, "text-anchor": "middle" }, `${v > 0 ? "+" : ""}${v * 100}`);
  rates.forEach((m, i) => {
    const y = top + i * row + row / 2;
    const color = m.change === "regressed" ? "#c0392b" : m.change === "improved" ? "#1f8f4e" : "#2f6fd6";
    node("text", { x: left - 8, y: y + 4, "text-anchor": "end" }, m.metric);
    if (m.ci_low !== null && m.ci_high !== null) {
      node("line", { x1: x(m.ci_low), y1: y, x2: x(m.ci_high), y2: y, stroke: color, "stroke-width": 3, "data-metric": m.metric });
    }
    node("circle", { cx: x(m.delta), cy: y, r: 5, fill: color });
  });
  return svg;
}

function runsCell(side) {
  if (!side) return el("td", { class: "empty" }, "–");
  return el("td", {}, side.runs.map((r) => el("div", {},
    el("a", { href: `#/run/${encodeURIComponent(r.run_id)}` }, r.trial ? `trial ${r.trial}` : "run"), " ",
    badge(r.verdict || "–", r.verdict), " ", el("span", { class: "mono" }, r.answer ?? "–"),
    el("div", { class: "sub" }, scoreText(r.scores)))));
}

function casesTable(bucket, items) {
  return el("table", { "data-testid": `cases-${bucket}` },
    el("thead", {}, el("tr", {}, ["case", "base", "candidate", ""].map((h) => el("th", {}, h)))),
    el("tbody", {}, items.map((item) => {
      const a = item.base?.runs?.[0]?.run_id, b = item.candidate?.runs?.[0]?.run_id;
      return el("tr", { "data-case": item.case_id, "data-change": item.change },
        el("td", {}, item.case_id), runsCell(item.base), runsCell(item.candidate),
        el("td", {}, a && b ? el("a", { href: `#/pair/${encodeURIComponent(a)}/${encodeURIComponent(b)}`, "data-testid": "side-by-side" }, "trajectories side by side") : ""));
    })));
}

function flakySection(baseView, candidateView) {
  const sides = [["base", baseView], ["candidate", candidateView]];
  if (sides.every(([, view]) => !view?.summary?.trials)) {
    return el("p", { class: "empty", "data-testid": "flaky" }, "Each case ran once in both batches: a case is flaky when it both passed and failed across trials (policy.trials > 1).");
  }
  return el("dl", { class: "kv", "data-testid": "flaky" }, sides.flatMap(([name, view]) => {
    const trials = view?.summary?.trials;
    const text = !trials ? "no trials" : trials.flaky ? `${trials.flaky} flaky: ${(trials.flaky_cases || []).join(", ")}${trials.flaky > (trials.flaky_cases || []).length ? " …" : ""}` : "none flaky";
    return [el("dt", {}, `${name} (${view?.batch_id ?? "?"})`), el("dd", {}, text)];
  }));
}

function gatesSection(gates) {
  if (!gates) return null;
  if (!gates.length) return el("p", { class: "empty", "data-testid": "gates" }, "The candidate declares no gates.");
  return el("table", { "data-testid": "gates" },
    el("thead", {}, el("tr", {}, ["gate", "verdict", "measured", "why"].map((h) => el("th", {}, h)))),
    el("tbody", {}, gates.map((g) => el("tr", { "data-gate": g.gate, "data-passed": String(g.passed) },
      el("td", { class: "mono" }, g.gate), el("td", {}, badge(g.passed ? "pass" : "fail")),
      el("td", { class: "num" }, g.measured === null || g.measured === undefined ? "–" : Number.isInteger(g.measured) ? String(g.measured) : fmt(g.measured)),
      el("td", {}, g.detail || "")))));
}

async function compareView(query) {
  const params = new URLSearchParams(query || "");
  const candidate = params.get("candidate") || "";
  const base = params.get("base") || "";
  const listed = await api("/v1/batches?limit=100");
  const finals = (listed.batches || []).filter((b) => b.finalized_at);
  const pickCandidate = el("select", { name: "candidate", "data-testid": "pick-candidate" },
    el("option", { value: "" }, "choose a batch"), finals.map((b) => batchOption(b, candidate)));
  const pickBase = el("select", { name: "base", "data-testid": "pick-base" },
    el("option", { value: "" }, "its suite's baseline"), finals.map((b) => batchOption(b, base)));
  for (const [select, value] of [[pickCandidate, candidate], [pickBase, base]]) {
    if (value && select.value !== value) select.append(el("option", { value, selected: true }, value));
  }
  const form = el("form", {
    class: "pick", "data-testid": "compare-form",
    onsubmit: (event) => {
      event.preventDefault();
      const next = new URLSearchParams({ candidate: pickCandidate.value });
      if (pickBase.value) next.set("base", pickBase.value);
      location.hash = `#/compare?${next}`;
    },
  }, el("label", {}, "candidate", pickCandidate), el("label", {}, "against (base)", pickBase),
  el("button", { type: "submit", "data-testid": "compare" }, "Compare"));
  const title = el("h1", {}, "Compare two batches");
  if (!candidate) {
    return show(title, el("p", { class: "sub" }, "Is the candidate better or worse than the base, and can it ship?"), form,
      el("p", { class: "empty", "data-testid": "empty" }, finals.length ? "Pick a candidate batch; the base defaults to its suite's baseline." : "No finalized batch yet."));
  }
  const query2 = new URLSearchParams({ candidate });
  if (base) query2.set("base", base);
  let result;
  try {
    result = await api(`/v1/compare?${query2}`);
  } catch (error) {
    if (error instanceof Unauthorized) throw error;
    return show(title, form, el("p", { class: "error", "data-testid": "compare-error" }, error.message));
  }
  const [baseView, candidateView] = await Promise.all([result.base, result.candidate].map(
    (batchId) => api(`/v1/batches/${encodeURIComponent(batchId)}`).catch(() => null)));
  const metrics = result.metrics || [];
  const regressed = metrics.filter((m) => m.change === "regressed").map((m) => m.metric);
  const improved = metrics.filter((m) => m.change === "improved").map((m) => m.metric);
  const cases = result.cases || {};
  const batchLink = (batchId) => el("a", { href: `#/batch/${encodeURIComponent(batchId)}` }, batchId);
  const verdict = el("p", { class: "verdict-line", "data-testid": "compare-verdict", "data-regressed": regressed.join(",") },
    regressed.length ? el("span", { class: "bad" }, `Regressed: ${regressed.join(", ")}`) : null,
    regressed.length && improved.length ? " · " : null,
    improved.length ? el("span", { class: "good" }, `Improved: ${improved.join(", ")}`) : null,
    !regressed.length && !improved.length ? "No significant change." : null,
    ` (q < ${result.alpha}, Benjamini–Hochberg across ${metrics.length} metrics) · cases: `,
    `${(cases.regressed || []).length} regressed, ${(cases.improved || []).length} improved, ${(cases.unchanged || []).length} unchanged`);
  const metricRows = metrics.map((m) => {
    const rate = m.statistic === "pass_rate";
    return el("tr", { "data-metric": m.metric, "data-change": m.change },
      el("td", {}, m.metric), el("td", {}, m.statistic), el("td", { class: "num" }, m.n),
      el("td", { class: "num" }, fmt(m.base, rate)), el("td", { class: "num" }, fmt(m.candidate, rate)),
      el("td", { class: "num" }, signed(m.delta, rate)),
      el("td", { class: "num" }, m.ci_low === null || m.ci_low === undefined ? "–" : `[${signed(m.ci_low, rate)}, ${signed(m.ci_high, rate)}]`),
      el("td", {}, m.test || "–"), el("td", { class: "num" }, pValue(m.p_value)), el("td", { class: "num" }, pValue(m.q_value)),
      el("td", {}, badge(m.change)));
  });
  const unchanged = cases.unchanged || [];
  show(title,
    el("p", { class: "sub" }, "candidate ", batchLink(result.candidate), ` (${result.candidate_suite || "–"}) against `,
      result.baseline ? "its suite's baseline " : "", batchLink(result.base), ` (${result.base_suite || "–"})`),
    form, verdict,
    el("h2", {}, "Metrics"),
    metrics.length ? el("div", {},
      el("table", { "data-testid": "compare-metrics" },
        el("thead", {}, el("tr", {}, ["metric", "statistic", "pairs", "base", "candidate", "delta", "95 % interval", "test", "p", "q", "change"].map((h) => el("th", {}, h)))),
        el("tbody", {}, metricRows)),
      el("div", { class: "chart-row" }, intervalChart(metrics))) : el("p", { class: "empty" }, "No metric in common."),
    ...(result.gates !== undefined ? [
      el("h2", {}, `Gates${result.gates.length ? ` (${result.gates.filter((g) => g.passed).length} of ${result.gates.length} passed)` : ""}`),
      gatesSection(result.gates)] : []),
    el("h2", {}, "Flaky cases"), flakySection(baseView, candidateView),
    ...BUCKETS.filter(([bucket]) => (cases[bucket] || []).length).flatMap(([bucket, heading, hint]) => [
      el("h2", {}, `${heading} (${cases[bucket].length})`), hint ? el("p", { class: "sub" }, hint) : null, casesTable(bucket, cases[bucket])]),
    unchanged.length ? el("details", {}, el("summary", {}, `Unchanged cases (${unchanged.length})`), casesTable("unchanged", unchanged)) : null);
}

async function pairView(baseRun, candidateRun) {
  // two runs' recorded trajectories side by side (a case in the base and in the candidate)
  const column = async (label, runId) => {
    const id = encodeURIComponent(runId);
    const [run, trajectory] = await Promise.all([api(`/v1/runs/${id}`).catch(() => null), api(`/v1/runs/${id}/trajectory`).catch(() => null)]);
    const list = el("ol", { class: "timeline" });
    timeline(list, trajectory ? sealedTrace(trajectory) : []);
    return el("section", { "data-testid": `pair-${label}` },
      el("h2", {}, `${label}: `, el("a", { href: `#/run/${id}` }, runId)),
      el("dl", { class: "kv" }, [["verdict", badge(run?.verdict || "–", run?.verdict)], ["answer", run?.answer ?? "–"], ["scores", scoreText(run?.scores) || "–"]]
        .flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
      list.childNodes.length ? list : el("p", { class: "empty" }, "No recorded trace."));
  };
  const [left, right] = await Promise.all([column("base", baseRun), column("candidate", candidateRun)]);
  show(el("h1", {}, "Two runs side by side"), el("div", { class: "grid2" }, left, right));
}

// ------------------------------------------------------------------ online

async function onlineView() {
  const listed = await api("/v1/online/suites");
  const items = listed.items || [];
  if (!items.length) {
    return show(el("h1", {}, "Online suites"),
      el("p", { class: "empty", "data-testid": "empty" }, "No online suite. Define one with: evalbus online apply examples/online-suite.yaml"));
  }
  show(el("h1", {}, "Online suites"),
    el("table", { "data-testid": "suites" },
      el("thead", {}, el("tr", {}, ["suite", "target", "ratio", "judges", "applied"].map((h) => el("th", {}, h)))),
      el("tbody", {}, items.map(({ suite, applied_by, applied_at }) => el("tr", { "data-suite": suite.id },
        el("td", {}, el("a", { href: `#/online/${encodeURIComponent(suite.id)}` }, suite.id)),
        el("td", {}, [suite.target.service, suite.target.agent, suite.target.workflow].filter(Boolean).join(" / ") +
          Object.entries(suite.target.attributes || {}).map(([k, v]) => ` ${k}=${v}`).join("")),
        el("td", { class: "num" }, fmt(suite.sample_ratio ?? 1, true)),
        el("td", {}, (suite.judges || []).map((j) => j.id).join(", ")),
        el("td", {}, `${when(applied_at)} by ${applied_by}`))))));
}

async function onlineSuiteView(suiteId) {
  const detail = await api(`/v1/online/suites/${encodeURIComponent(suiteId)}`);
  const windows = ["hour", "day", "week"];
  const metrics = [...new Set(detail.metrics.map((m) => m.metric))];
  const cell = (metric, window) => detail.metrics.find((m) => m.metric === metric && m.window === window);
  show(el("h1", {}, `Online suite ${detail.suite.id}`),
    // a field left at its default is not in the JSON (sample_ratio 1.0)
    el("p", { class: "sub", "data-testid": "suite-facts" }, `ratio ${fmt(detail.suite.sample_ratio ?? 1, true)} · applied ${when(detail.applied_at)} by ${detail.applied_by}`),
    el("h2", {}, "Scores"),
    metrics.length ? el("div", { class: "grid2" },
      el("table", { "data-testid": "online-metrics" },
        el("thead", {}, el("tr", {}, el("th", {}, "metric"), windows.map((w) => el("th", { class: "num" }, `last ${w}`)))),
        el("tbody", {}, metrics.map((metric) => el("tr", {}, el("td", {}, metric), windows.map((w) => {
          const c = cell(metric, w);
          return el("td", { class: "num" }, c ? `${c.pass_rate != null ? fmt(c.pass_rate, true) : fmt(c.mean)} (n=${c.count})` : "–");
        }))))),
      lineChart(detail.series || [], "pass rate by hour, last 24 h"))
      : el("p", { class: "empty" }, "Nothing judged yet."),
    el("h2", {}, "What became of every observation"),
    el("table", { "data-testid": "online-fates" },
      el("thead", {}, el("tr", {}, ["fate", "reason", "count"].map((h) => el("th", {}, h)))),
      el("tbody", {}, detail.fates.map((f) => el("tr", {}, el("td", {}, badge(f.fate)), el("td", {}, f.reason), el("td", { class: "num" }, f.count))))),
    el("h2", {}, "Recently judged"),
    detail.recent.length ? el("table", { "data-testid": "online-recent" },
      el("thead", {}, el("tr", {}, ["observation", "judged", "answer", "scores"].map((h) => el("th", {}, h)))),
      el("tbody", {}, detail.recent.map((r) => el("tr", {},
        el("td", {}, el("a", { href: `#/run/${encodeURIComponent(r.run_id)}` }, r.observation_id)),
        el("td", {}, when(r.judged_at)), el("td", {}, r.answer ?? "–"), el("td", {}, scoreText(r.scores))))))
      : el("p", { class: "empty" }, "Nothing judged yet."));
}

// ------------------------------------------------------------------ routing

const ROUTES = [
  [/^#\/batches$/, () => batchesView(), "batches"],
  [/^#\/batch\/(.+)$/, (m) => batchView(decodeURIComponent(m[1])), "batches"],
  [/^#\/run\/(.+)$/, (m) => runView(decodeURIComponent(m[1])), "batches"],
  [/^#\/compare(?:\?(.*))?$/, (m) => compareView(m[1]), "compare"],
  [/^#\/pair\/([^/]+)\/([^/]+)$/, (m) => pairView(decodeURIComponent(m[1]), decodeURIComponent(m[2])), "compare"],
  [/^#\/online$/, () => onlineView(), "online"],
  [/^#\/online\/(.+)$/, (m) => onlineSuiteView(decodeURIComponent(m[1])), "online"],
];

// Pages render one after another, in the order they were asked for: a page still loading when the
// reader moves on (or the first page, when the address already names another) cannot land after
// the newer one and replace it.
let routing = Promise.resolve();
function route() {
  routing = routing.then(renderRoute, renderRoute);
  return routing;
}

async function renderRoute() {
  closeStreams();
  const hash = location.hash || "#/batches";
  for (const [pattern, view, nav] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    for (const link of document.querySelectorAll("header nav a")) link.classList.toggle("active", link.dataset.nav === nav);
    show(el("p", { class: "loading" }, "Loading…"));
    try { await view(match); } catch (error) { failed(error); }
    return;
  }
  location.hash = "#/batches";
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", async () => {
  try {
    await whoAmI();
    route();
  } catch (error) {
    if (error instanceof Unauthorized) loginView(); else failed(error);
  }
});
