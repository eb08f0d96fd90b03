/* swarmpipe dashboard: polls the coordinator's JSON API and draws the swarm. No dependencies. */
"use strict";

const REFRESH_MS = 2000;
const STALE_RECORD_S = 15;   // a record this old is about to expire from the DHT
const SVG_NS = "http://www.w3.org/2000/svg";

// ------------------------------------------------------------------ helpers
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, String(value));
  }
  return node;
}

function stat(label, value, cls) {
  return el("span", { class: cls }, label + " ", el("b", { text: value }));
}

const shortId = (id) => (id ? String(id).slice(-6) : "------");

function fmtNum(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const d = digits !== undefined ? digits : Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
  return Number(v).toFixed(d);
}

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

const GIB = 2 ** 30;

// A peer's device memory as "used / total GiB"; null when the peer does not report it (an older peer).
function fmtMemory(used, total) {
  if (!total || !isFinite(total)) return null;
  return fmtNum((used || 0) / GIB) + " / " + fmtNum(total / GIB) + " GiB";
}

// The device column: "cuda:0 (NVIDIA H200) · 12.3 / 141 GiB", or "-" for a peer that reports neither.
function fmtDevice(p) {
  const mem = fmtMemory(p.device_memory_used, p.device_memory_total);
  if (!p.device) return mem || "-";
  return p.device + " · " + (mem || "-");
}

function fmtClock(t) {
  const d = new Date(t * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((x) => String(x).padStart(2, "0")).join(":");
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

// The stage with the least total throughput (first on a tie), as the coordinator's /metrics says.
function bottleneckIndex(stages) {
  let best = null;
  for (const s of stages) {
    if (best === null || s.throughput < best.throughput) best = s;
  }
  return best === null ? null : best.index;
}

// ------------------------------------------------------------------ header
function renderSummary(snap, history) {
  const trainers = snap.trainers || [];
  const stages = snap.stages || [];
  const losses = trainers.map((t) => t.loss).filter((l) => l !== null && l !== undefined);
  const loss = losses.length ? losses.reduce((a, b) => a + b, 0) / losses.length : null;
  const valLosses = trainers.map((t) => t.val_loss).filter((l) => l !== null && l !== undefined);
  const valLoss = valLosses.length ? valLosses.reduce((a, b) => a + b, 0) / valLosses.length : null;
  const sps = trainers.reduce((a, t) => a + (t.samples_per_s || 0), 0);
  const step = trainers.reduce((a, t) => Math.max(a, t.step || 0), 0);
  const peers = stages.reduce((a, s) => a + (s.peers || []).length, 0);
  document.getElementById("run-id").textContent = snap.run_id || "";
  document.getElementById("sum-loss").textContent = fmtNum(loss, 3);
  document.getElementById("sum-val-loss").textContent = fmtNum(valLoss, 3);
  document.getElementById("sum-sps").textContent = trainers.length ? fmtNum(sps, 1) : "–";
  document.getElementById("sum-step").textContent = trainers.length ? String(step) : "–";
  document.getElementById("sum-peers").textContent = String(peers);
  document.getElementById("sum-trainers").textContent = String(trainers.length);
  const ckpt = snap.checkpoint;
  const now = snap.updated_at || Date.now() / 1000;
  document.getElementById("sum-checkpoint").textContent =
    ckpt ? "#" + ckpt.step + " · " + fmtAge(now - ckpt.created_at) + " ago" : "none";
  document.title = "swarmpipe · " + (snap.run_id || "") + (loss !== null ? " · loss " + fmtNum(loss, 3) : "");
}

// ------------------------------------------------------------------ pipeline
function renderPipeline(snap) {
  const root = document.getElementById("pipeline");
  const stages = snap.stages || [];
  const polledAt = snap.updated_at || Date.now() / 1000;
  const slowest = bottleneckIndex(stages);
  const maxPeerTp = Math.max(1e-9, ...stages.flatMap((s) => (s.peers || []).map((p) => p.throughput || 0)));
  let replicas = 0;
  const nodes = [];
  stages.forEach((stage, i) => {
    const peers = stage.peers || [];
    replicas += peers.length;
    const maxVersion = peers.reduce((a, p) => Math.max(a, p.version || 0), 0);
    const isBottleneck = stage.index === slowest && stages.length > 0;
    const queue = peers.reduce((a, p) => a + (p.queue || 0), 0);
    const box = el("div", {
      class: "stage" + (isBottleneck ? " bottleneck" : "") + (peers.length ? "" : " empty"),
      "data-index": stage.index, "data-replicas": peers.length, "data-throughput": fmtNum(stage.throughput, 3),
      "data-bottleneck": isBottleneck ? "true" : "false",
    },
      el("div", { class: "stage-head" },
        el("span", { class: "stage-title" }, "Stage " + stage.index,
           isBottleneck ? el("span", { class: "badge bottleneck", text: "bottleneck" }) : null),
        el("span", { class: "stage-tp", title: "total throughput of non-draining replicas, micro-batches/s",
                     text: fmtNum(stage.throughput) + " mb/s" })),
      el("div", { class: "stage-meta" },
        stat("replicas", String(peers.length)), stat("queue", String(queue)), stat("version", String(maxVersion))));
    if (!peers.length) box.appendChild(el("div", { class: "no-peers", text: "no peers: the pipeline is broken here" }));
    for (const p of peers) {
      const lag = maxVersion - (p.version || 0);
      const age = Math.max(0, polledAt - (p.updated_at || polledAt));
      const stale = age > STALE_RECORD_S;
      const width = Math.min(100, (100 * (p.throughput || 0)) / maxPeerTp);
      box.appendChild(el("div", {
        class: "replica" + (stale ? " stale" : ""), "data-peer-id": p.peer_id, "data-state": p.state,
        "data-version": p.version, "data-lag": lag, "data-age": fmtNum(age, 1), title: p.peer_id,
      },
        el("span", { class: "peer", text: shortId(p.peer_id) }),
        el("span", { class: "state", text: p.state }),
        el("span", { class: "addr", text: p.address + (p.relay ? "  ·  via relay " + p.relay.slice(-6) : "")
                                          + (p.metrics_address ? "  ·  metrics " + p.metrics_address : "") }),
        el("div", { class: "device", title: fmtDevice(p), "data-device": p.device || "",
                    "data-memory": fmtMemory(p.device_memory_used, p.device_memory_total) || "-" },
          el("span", { class: "label", text: "device " }), el("b", { text: fmtDevice(p) })),
        el("div", { class: "bar" }, el("span", { style: "width:" + width.toFixed(1) + "%" })),
        el("div", { class: "stats" },
          stat("", fmtNum(p.throughput) + " mb/s", "tp"),
          stat("queue", String(p.queue)),
          stat("v", String(p.version)),
          stat("lag", lag ? "−" + lag : "0", "lag" + (lag > 0 ? " behind" : "")),
          stat("seen", fmtAge(age) + " ago", "age"))));
    }
    if (i > 0) nodes.push(el("div", { class: "arrow", text: "→" }));
    nodes.push(box);
  });
  if (!stages.length) nodes.push(el("div", { class: "no-peers", text: "waiting for the coordinator's first poll…" }));
  root.replaceChildren(...nodes);
  root.setAttribute("data-stages", String(stages.length));
  root.setAttribute("data-replicas", String(replicas));
  root.setAttribute("data-bottleneck", slowest === null ? "" : String(slowest));
}

// ------------------------------------------------------------------ charts
function niceStep(range, ticks) {
  const raw = range / Math.max(1, ticks);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
}

// opts.second: an optional second series (points {t, v}) drawn as a line of class "val" on the same axes.
function renderChart(id, points, opts) {
  const chart = document.getElementById(id);
  const width = Math.max(200, Math.round(chart.getBoundingClientRect().width || 600));
  const height = Math.max(120, Math.round(chart.getBoundingClientRect().height || 220));
  const second = opts.second || [];
  chart.setAttribute("viewBox", "0 0 " + width + " " + height);
  chart.setAttribute("data-points", String(points.length));
  if (opts.second) chart.setAttribute("data-val-points", String(second.length));
  const children = [];
  const pad = { left: 48, right: 12, top: 10, bottom: 24 };
  const w = width - pad.left - pad.right;
  const h = height - pad.top - pad.bottom;
  if (points.length < 2) {
    children.push(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty-label",
                               text: points.length ? "one point so far…" : "no data yet" }));
    chart.replaceChildren(...children);
    return;
  }
  const all = points.concat(second);
  const t0 = Math.min(...all.map((p) => p.t));
  const t1 = Math.max(...all.map((p) => p.t));
  let lo = Math.min(...all.map((p) => p.v));
  let hi = Math.max(...all.map((p) => p.v));
  if (opts.zero) lo = Math.min(0, lo);
  if (hi - lo < 1e-9) { hi += 1; lo -= opts.zero ? 0 : 1; }
  const step = niceStep(hi - lo, 4);
  lo = Math.floor(lo / step) * step;
  hi = Math.ceil(hi / step) * step;
  const x = (t) => pad.left + (t1 > t0 ? ((t - t0) / (t1 - t0)) * w : w);
  const y = (v) => pad.top + h - ((v - lo) / (hi - lo)) * h;
  for (let v = lo; v <= hi + step / 2; v += step) {
    children.push(svg("line", { x1: pad.left, x2: pad.left + w, y1: y(v), y2: y(v), class: "grid" }));
    children.push(svg("text", { x: pad.left - 6, y: y(v) + 4, "text-anchor": "end", class: "axis-label",
                               text: fmtNum(v, step >= 1 ? 0 : step >= 0.1 ? 1 : 2) }));
  }
  const xTicks = 4;
  for (let i = 0; i <= xTicks; i++) {
    const t = t0 + ((t1 - t0) * i) / xTicks;
    children.push(svg("text", { x: x(t), y: height - 6, "text-anchor": i === 0 ? "start" : i === xTicks ? "end" : "middle",
                               class: "axis-label", text: fmtClock(t) }));
  }
  const line = points.map((p, i) => (i ? "L" : "M") + x(p.t).toFixed(1) + "," + y(p.v).toFixed(1)).join(" ");
  const area = line + " L" + x(t1).toFixed(1) + "," + y(lo).toFixed(1) + " L" + x(t0).toFixed(1) + "," + y(lo).toFixed(1) + " Z";
  children.push(svg("path", { d: area, class: "area" }));
  children.push(svg("path", { d: line, class: "series" }));
  const last = points[points.length - 1];
  children.push(svg("circle", { cx: x(last.t), cy: y(last.v), r: 3.5, class: "dot" }));
  if (second.length) {
    const path = second.map((p, i) => (i ? "L" : "M") + x(p.t).toFixed(1) + "," + y(p.v).toFixed(1)).join(" ");
    if (second.length > 1) children.push(svg("path", { d: path, class: "series val" }));
    const end = second[second.length - 1];
    children.push(svg("circle", { cx: x(end.t), cy: y(end.v), r: 3.5, class: "dot val" }));
  }
  chart.replaceChildren(...children);
}

function renderCharts(history) {
  const loss = history.filter((p) => p.loss !== null && p.loss !== undefined).map((p) => ({ t: p.time, v: p.loss }));
  const val = history.filter((p) => p.val_loss !== null && p.val_loss !== undefined).map((p) => ({ t: p.time, v: p.val_loss }));
  // Samples/s from the first moment a trainer reported on: idle swarm time before that is not interesting.
  const firstTrainer = history.findIndex((p) => (p.step || 0) > 0 || (p.samples_per_s || 0) > 0);
  const sps = firstTrainer < 0 ? [] : history.slice(firstTrainer).map((p) => ({ t: p.time, v: p.samples_per_s || 0 }));
  renderChart("loss-chart", loss, { zero: false, second: val });
  renderChart("sps-chart", sps, { zero: true });
  document.getElementById("loss-latest").textContent = (loss.length ? "now " + fmtNum(loss[loss.length - 1].v, 3) : "") +
    (val.length ? " · val " + fmtNum(val[val.length - 1].v, 3) : "");
  document.getElementById("sps-latest").textContent = sps.length ? "now " + fmtNum(sps[sps.length - 1].v, 1) : "";
}

// ------------------------------------------------------------------ trainers and events
function renderTrainers(snap) {
  const body = document.querySelector("#trainers tbody");
  const now = snap.updated_at || Date.now() / 1000;
  const rows = (snap.trainers || []).map((t) => el("tr", { class: "trainer", "data-peer-id": t.peer_id },
    el("td", { class: "peer", text: shortId(t.peer_id), title: t.peer_id }),
    el("td", { text: String(t.step) }),
    el("td", { text: fmtNum(t.loss, 3) }),
    el("td", { class: "val-loss", text: fmtNum(t.val_loss, 3) }),
    el("td", { text: fmtNum(t.samples_per_s, 1) }),
    el("td", { text: String(t.microbatches_completed) }),
    el("td", { text: String(t.microbatches_retried) }),
    el("td", { text: String(t.microbatches_lost) }),
    el("td", { text: fmtAge(now - t.updated_at) })));
  if (!rows.length) rows.push(el("tr", {}, el("td", { class: "empty", colspan: 9, text: "no trainer is announcing" })));
  body.replaceChildren(...rows);
}

// Turns the coordinator's membership diffs into words: joins, drains, rebalances, deaths, checkpoints.
function describeEvents(events) {
  const known = new Map();  // peer -> {stage, state}
  const out = [];
  for (const e of events) {
    const peer = shortId(e.peer);
    let label = e.kind;
    let detail = "";
    if (e.kind === "peer_joined") {
      label = "joined";
      detail = "peer " + peer + " joined stage " + e.stage + " (" + e.state + ")";
      known.set(e.peer, { stage: e.stage, state: e.state });
    } else if (e.kind === "peer_changed") {
      const before = known.get(e.peer);
      if (before && before.stage !== e.stage) {
        label = "rebalance";
        detail = "peer " + peer + " moved stage " + before.stage + " → " + e.stage;
      } else if (e.state === "draining") {
        label = "draining";
        detail = "peer " + peer + " of stage " + e.stage + " is draining";
      } else {
        label = e.state;
        detail = "peer " + peer + " of stage " + e.stage + " is " + e.state;
      }
      known.set(e.peer, { stage: e.stage, state: e.state });
    } else if (e.kind === "peer_gone") {
      const before = known.get(e.peer);
      label = before && before.state === "draining" ? "left" : "gone";
      detail = "peer " + peer + " of stage " + e.stage + (label === "left" ? " left after draining" : " vanished (died or record expired)");
      known.delete(e.peer);
    } else if (e.kind === "checkpoint") {
      label = "checkpoint";
      const versions = Object.entries(e.versions || {}).map(([s, v]) => "s" + s + "@v" + v).join(" ");
      detail = "#" + e.step + " (" + (e.reason || "") + ") " + versions;
    } else {
      detail = Object.entries(e).filter(([k]) => k !== "time" && k !== "kind").map(([k, v]) => k + "=" + v).join(" ");
    }
    out.push({ time: e.time, kind: e.kind, label, detail });
  }
  return out;
}

function renderEvents(events) {
  const list = document.getElementById("events");
  const items = describeEvents(events).reverse().slice(0, 100).map((e) =>
    el("li", { class: "event", "data-kind": e.kind, "data-label": e.label },
      el("span", { class: "time", text: fmtClock(e.time) }),
      el("span", { class: "kind", text: e.label }),
      el("span", { class: "detail", text: e.detail, title: e.detail })));
  if (!items.length) items.push(el("li", { class: "empty", text: "nothing happened yet" }));
  list.replaceChildren(...items);
  list.setAttribute("data-count", String(events.length));
}

// ------------------------------------------------------------------ loop
function setStatus(state, text) {
  const node = document.getElementById("status");
  node.setAttribute("data-state", state);
  node.textContent = text;
}

async function refresh() {
  try {
    const [snap, history, events] = await Promise.all([getJSON("api/swarm"), getJSON("api/history"), getJSON("api/events")]);
    renderSummary(snap, history);
    renderPipeline(snap);
    renderCharts(history);
    renderTrainers(snap);
    renderEvents(events);
    const age = snap.updated_at ? Date.now() / 1000 - snap.updated_at : null;
    setStatus("live", snap.updated_at ? "live · polled " + fmtAge(age) + " ago" : "waiting for first poll");
    document.getElementById("updated").textContent = "updated " + fmtClock(Date.now() / 1000);
    document.body.setAttribute("data-refreshed", String(Number(document.body.getAttribute("data-refreshed") || 0) + 1));
  } catch (err) {
    setStatus("error", "coordinator unreachable: " + err.message);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
