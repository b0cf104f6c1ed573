// psd-jax playground: asks the server's own /v1/chat/completions with "trace": true and replays the
// answer's trace (docs/trace.md) as the canvas filled, one frame per model call. Plain JavaScript,
// no build step, nothing fetched from outside the server.
"use strict";

const MASK = "\u2591";
const STOP = "\u00b7";
// "?fast": replay without pauses (a test drives the page; a person gets about four seconds a replay)
const FAST = new URLSearchParams(window.location.search).has("fast");
const state = { config: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("psd-jax-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function makePane(name, preset) {
  const pane = document.getElementById("pane-template").content.firstElementChild.cloneNode(true);
  pane.id = "pane-" + name;
  pane.dataset.name = name;
  const form = pane.querySelector("form");
  const d = state.config.defaults;
  if (state.config.recommended) form.settings.add(new Option("recommended", "recommended"));
  for (const field of ["decoder", "policy", "threshold", "cache", "block_length"]) form[field].value = d[field];
  if (preset) form.settings.value = preset;
  const sync = () => {
    // A named setting shows its own values (the server resolves it), read-only.
    const named = form.settings.value !== "";
    const shown = named ? state.config.recommended : d;
    for (const field of ["decoder", "policy", "threshold", "cache", "block_length"]) {
      form[field].disabled = named;
      if (named || form[field].dataset.named === "true") form[field].value = shown[field];
      form[field].dataset.named = String(named);
    }
  };
  form.settings.addEventListener("change", sync);
  sync();
  return pane;
}

function body(pane, prompt) {
  const form = pane.querySelector("form");
  const out = { model: state.config.model, messages: [{ role: "user", content: prompt }], trace: true };
  if (form.settings.value) {
    out.settings = form.settings.value;
    return out;
  }
  const d = state.config.defaults;
  for (const field of ["decoder", "policy", "cache"]) {
    if (form[field].value !== d[field]) out[field] = form[field].value;
  }
  const threshold = parseFloat(form.threshold.value);
  if (threshold !== d.threshold) out.threshold = threshold;
  const block = parseInt(form.block_length.value, 10);
  if (block !== d.block_length) out.block_length = block;
  return out;
}

function frameOf(trace, t, end) {
  // Each position's text and class at frame t (the canvas after the row's call t).
  const cells = [];
  for (let i = 0; i < trace.step.length; i++) {
    const step = trace.step[i], again = trace.rewritten[i];
    if (step === 0 || step > t) {
      cells.push({ text: t === trace.steps && step === 0 ? "" : MASK, cls: "mask" });
      continue;
    }
    let text = again && again > t ? trace.first_pieces[i] : trace.pieces[i];
    if (i >= end) text = STOP;  // after the answer's end (its end-of-sequence ids)
    let cls = i >= end ? "after" : "";
    let title = "";
    if (again === t) cls = "k-edit";
    else if (step === t) {
      const kind = trace.kind[i];
      cls = kind.startsWith("draft") ? "k-draft" : "k-" + (kind === "edit" ? "policy" : kind);
      title = kind;
    }
    cells.push({ text: text, cls: cls, title: title, now: step === t || again === t });
  }
  return cells;
}

function draw(canvas, trace, t, end) {
  const cells = frameOf(trace, t, end);
  const block = trace.block_length;
  const current = new Set();
  cells.forEach((c, i) => { if (c.now) current.add(Math.floor(i / block)); });
  if (current.size) canvas.dataset.window = [...current].join(",");
  const windows = new Set((canvas.dataset.window || "").split(",").filter((x) => x !== "").map(Number));
  canvas.replaceChildren();
  for (let b = 0; b * block < cells.length; b++) {
    const row = el("span", "block" + (windows.has(b) && t < trace.steps ? " current" : ""));
    for (const c of cells.slice(b * block, (b + 1) * block)) {
      const span = el("span", c.cls, c.text);
      if (c.title) span.title = c.title;
      row.appendChild(span);
    }
    canvas.appendChild(row);
  }
  canvas.dataset.step = String(t);
}

function animate(pane, trace, usage, seconds) {
  const canvas = pane.querySelector(".canvas");
  const stats = pane.querySelector(".stats");
  const steps = usage.model_calls;
  trace.steps = steps;
  const end = usage.completion_tokens;
  canvas.dataset.steps = String(steps);
  canvas.dataset.done = "false";
  const tps = seconds > 0 ? usage.completion_tokens / seconds : 0;
  const line = (t) =>
    `step ${t}/${steps} \u00b7 NFE ${steps} \u00b7 TPF ${usage.tokens_per_forward.toFixed(2)} \u00b7 ` +
    `${usage.completion_tokens} tokens \u00b7 ${tps.toFixed(1)} tokens/s (this request, as the browser saw it)`;
  const pause = FAST ? 0 : Math.min(250, 4000 / Math.max(steps, 1));
  return new Promise((resolve) => {
    let t = 0;
    const tick = () => {
      draw(canvas, trace, t, end);
      stats.textContent = line(t);
      if (t >= steps) {
        canvas.dataset.text = trace.pieces.slice(0, end).join("");
        canvas.dataset.done = "true";
        resolve();
        return;
      }
      t += 1;
      setTimeout(tick, pause);
    };
    tick();
  });
}

async function decode(pane, prompt) {
  const stats = pane.querySelector(".stats");
  const answer = pane.querySelector(".answer");
  const canvas = pane.querySelector(".canvas");
  stats.className = "stats muted";
  stats.textContent = "decoding\u2026";
  answer.textContent = "";
  canvas.replaceChildren();
  canvas.dataset.done = "false";
  const began = performance.now();
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(body(pane, prompt)),
  });
  const seconds = (performance.now() - began) / 1000;
  const reply = await response.json();
  if (!response.ok) {
    stats.className = "stats error";
    stats.textContent = `${response.status}: ${reply.error ? reply.error.message : response.statusText}`;
    canvas.dataset.done = "error";
    return;
  }
  const choice = reply.choices[0];
  await animate(pane, choice.trace, reply.usage, seconds);
  answer.textContent = choice.message.content;
}

async function run() {
  const prompt = document.getElementById("prompt").value.trim();
  const status = document.getElementById("status");
  if (!prompt) {
    status.textContent = "write a prompt first";
    return;
  }
  status.textContent = "";
  const panes = [...document.querySelectorAll(".pane")].filter((p) => !p.hidden);
  document.getElementById("run").disabled = true;
  try {
    await Promise.all(panes.map((p) => decode(p, prompt)));
  } catch (error) {
    status.textContent = String(error);
  } finally {
    document.getElementById("run").disabled = false;
  }
}

async function start() {
  state.config = await (await fetch("/playground/config")).json();
  document.getElementById("model").textContent = state.config.model;
  if (state.config.key_required) {
    const box = document.getElementById("keybox"), input = document.getElementById("key");
    box.hidden = false;
    input.value = sessionStorage.getItem("psd-jax-key") || "";
    input.addEventListener("input", () => sessionStorage.setItem("psd-jax-key", input.value.trim()));
  }
  const panes = document.getElementById("panes");
  panes.appendChild(makePane("a", ""));
  panes.appendChild(makePane("b", state.config.recommended ? "recommended" : ""));
  const compare = document.getElementById("compare");
  const sync = () => { document.getElementById("pane-b").hidden = !compare.checked; };
  compare.addEventListener("change", sync);
  sync();
  document.getElementById("run").addEventListener("click", run);
  document.body.dataset.ready = "true";
}

start();
