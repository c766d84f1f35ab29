// The evalbus dashboard: plain JavaScript, no build step. Every view reads the gateway's /v1 API
// (the session cookie authenticates it) and follows its event streams with EventSource.
"use strict";

const main = () => document.getElementById("main");
const streams = new Set(); // EventSources of the current page, closed when the page changes

// ------------------------------------------------------------------ helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
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
  root.replaceChildren(...nodes);
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
      const counts = { ...batch.counts };
      follow(`/v1/batches/${encodeURIComponent(batch.batch_id)}/events`, Object.fromEntries([
        ...["case.requested", "case.executed", "case.judged", "case.exported"].map((type) => [type, () => {
          const stage = type.split(".")[1];
          counts[stage] = (counts[stage] || 0) + 1;
          cell.replaceChildren(progress(counts, batch.total_runs));
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
      progress(view.counts, view.total_runs), ...(cancel ? [cancel] : []));
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
  const refresh = async (runId) => {
    try { renderRow(await api(`/v1/runs/${encodeURIComponent(runId)}`)); } catch (_) { /* recorded a moment later */ }
  };
  const pending = new Map();
  const soon = (runId) => {
    clearTimeout(pending.get(runId));
    pending.set(runId, setTimeout(() => refresh(runId), 150));
  };
  follow(`/v1/batches/${id}/events`, {
    "case.requested": (e) => soon(e.run_id),
    "case.executed": (e) => soon(e.run_id),
    "case.collected": (e) => soon(e.run_id),
    "case.judged": (e) => soon(e.run_id),
    "case.exported": (e) => soon(e.run_id),
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

async function runView(runId) {
  const id = encodeURIComponent(runId);
  const run = await api(`/v1/runs/${id}`).catch((error) => (error.status === 404 ? null : Promise.reject(error)));
  const title = el("h1", {}, `Run ${runId}`);
  const facts = el("dl", { class: "kv", "data-testid": "run-facts" });
  const log = el("pre", { class: "log", "data-testid": "log" });
  const trace = el("ol", { class: "timeline", "data-testid": "trace" });
  const traceNote = el("p", { class: "sub", "data-testid": "trace-state" }, "Live trace");
  const placement = el("div", { "data-testid": "placement" });

  function renderFacts(view) {
    const rows = view ? [
      ["case", view.case_id], ["batch", view.batch_id ? el("a", { href: `#/batch/${encodeURIComponent(view.batch_id)}` }, view.batch_id) : "–"],
      ["stage", badge(view.stage)], ["execution", badge(view.executed_status || "–", view.executed_status)],
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
    el("h2", {}, "Placement"), placement);

  api(`/v1/runs/${id}/placement`).then((p) => {
    placement.replaceChildren(el("dl", { class: "kv" },
      ...Object.entries(p).filter(([, v]) => typeof v !== "object").flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])));
  }).catch(() => placement.replaceChildren(el("p", { class: "empty" }, "No placement to show.")));

  follow(`/v1/runs/${id}/logs/stream`, {
    log: (chunk) => {
      const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      log.append(el("span", { class: chunk.stream }, chunk.text));
      if (atEnd) log.scrollTop = log.scrollHeight;
    },
  });
  const live = follow(`/v1/runs/${id}/trajectory/live/stream`, { trace: (event) => timeline(trace, [event]) });
  live.addEventListener("end", async () => {
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
