// The health page: /api/monitor rendered as one section per run. Every value from the DHT is text, never HTML.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function ago(t) {
  if (!t) return "-";
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 120 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(0)} min ago`;
}

function helpLine(run) {
  if (!run.help) return el("p", { class: "help" }, "no spec published yet");
  const sizes = Object.entries(run.help.by_gpu_memory_gib)
    .map(([gib, stage]) => `${gib} GB: ${stage === null ? "no stage fits" : "stage " + stage}`);
  return el("p", { class: "help", "data-neediest": run.help.neediest_stage },
    `A volunteer helps most at stage ${run.help.neediest_stage}`,
    ` (swarmpipe peer --run-id ${run.run_id} --stage auto picks, by GPU memory: ${sizes.join(", ")})`);
}

function stageTable(run) {
  const table = el("table", { class: "stages" },
    el("tr", {}, ...["stage", "replicas", "relayed", "mb/s", "versions"].map((h) => el("th", {}, h))));
  for (const s of run.stages) {
    table.append(el("tr", { class: s.replicas ? "stage" : "stage empty", "data-stage": s.index,
      "data-replicas": s.replicas },
    el("td", {}, s.index), el("td", { class: "num" }, s.replicas || "NO PEERS"),
    el("td", { class: "num" }, s.relayed), el("td", { class: "num" }, s.throughput.toFixed(2)),
    el("td", {}, s.versions.join(", ") || "-")));
  }
  return table;
}

function peerTable(run) {
  const table = el("table", { class: "peers" },
    el("tr", {}, ...["stage", "peer", "state", "address", "relay", "version", "device", "seen", "reachability"]
      .map((h) => el("th", {}, h))));
  for (const s of run.stages) {
    for (const p of s.peers) {
      const r = p.reachability || { last: "unknown", history: "" };
      table.append(el("tr", { class: "peer", "data-peer": p.peer_id, "data-reachable": r.last },
        el("td", {}, s.index), el("td", {}, p.peer_id.slice(-6)), el("td", {}, p.state),
        el("td", {}, p.address), el("td", {}, p.relayed ? "via " + p.relay.slice(-6) : "direct"),
        el("td", { class: "num" }, p.version), el("td", {}, p.device || "-"), el("td", {}, ago(p.updated_at)),
        el("td", { class: "history", title: r.last }, r.history || "-")));
    }
    if (s.peers_not_listed) table.append(el("tr", {}, el("td", { colspan: 9, class: "muted" },
      `${s.peers_not_listed} more replicas of stage ${s.index} not listed`)));
  }
  return table;
}

function runSection(run) {
  const model = run.model ? `${run.model.family}, d_model ${run.model.d_model}, ${run.model.n_layers} layers` +
    (run.model.finetune === "lora" ? ", LoRA" : "") : "spec not found";
  const saved = run.checkpoint && run.checkpoint.versions.some((v) => v >= 0);
  const ckpt = saved ? `checkpoint step ${run.checkpoint.step}, ${ago(run.checkpoint.created_at)}`
    : "no checkpoint yet";
  const trainers = run.trainers.map((t) => `trainer ${t.peer_id.slice(-6)}: step ${t.step}` +
    (t.loss === null ? "" : `, loss ${t.loss.toFixed(3)}`) + `, ${t.samples_per_s.toFixed(1)} samples/s`);
  return el("section", { class: "run", "data-run": run.run_id },
    el("h2", {}, `run ${run.run_id}`),
    el("p", { class: "muted" }, `${model}; ${run.num_stages} stages; ${ckpt}`),
    helpLine(run), stageTable(run),
    el("p", { class: "trainers" }, trainers.length ? trainers.join(" | ") : "no trainer announced"),
    peerTable(run));
}

async function refresh() {
  try {
    const response = await fetch("/api/monitor", { cache: "no-store" });
    const data = await response.json();
    const runs = document.getElementById("runs");
    runs.replaceChildren(...data.runs.map(runSection));
    const peers = data.runs.reduce((n, r) => n + r.stages.reduce((m, s) => m + s.peers.length, 0), 0);
    document.getElementById("summary").textContent = data.updated_at
      ? `${data.runs.length} runs, ${peers} peers; read ${ago(data.updated_at)}` : "reading the swarm...";
  } catch (e) {
    document.getElementById("summary").textContent = `the monitor did not answer: ${e}`;
  }
}

refresh();
setInterval(refresh, 5000);
