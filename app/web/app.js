// The web page: a chat (and a completion tab) with the served model, each streamed token shown
// with where it came from (the `speculation.trace` extension), a strip chart of the rounds, and
// a live panel of the server (`GET /v1/speculation/status`). Plain JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const STATUS_EVERY_MS = 2000;
// a source's CSS class: the strategies the mix uses have their own; model drafts share one
const SOURCE_CLASS = {
  context: "src-context", extended_bigram: "src-extended_bigram", recycled: "src-recycled",
  suffix: "src-suffix", logit: "src-logit", bigram: "src-table", unigram: "src-table",
  token_recycling: "src-table",
};
const LEGEND = [
  ["context", "context n-gram"], ["extended_bigram", "model bigram"], ["recycled", "recycled"],
  ["suffix", "suffix"], ["logit", "logit"], ["self_draft", "model drafts"],
  ["bigram", "tables"], ["model", "model's own"],
];

const sourceClass = (source) =>
  SOURCE_CLASS[source] || (/self_draft|draft_model/.test(source) ? "src-model-draft" : "src-other");

// --- settings, kept in the browser: the API key for the tab's session only -----------------
const FIELDS = ["mode", "k", "w", "strategy", "temperature", "top-p", "max-tokens"];
const SETTINGS = "ngrammys.settings";
const KEY = "ngrammys.key";

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const name of FIELDS) {
    if (saved[name] !== undefined) $("set-" + name).value = saved[name];
  }
  $("set-key").value = sessionStorage.getItem(KEY) || "";
}

function saveSettings() {
  const saved = {};
  for (const name of FIELDS) saved[name] = $("set-" + name).value;
  localStorage.setItem(SETTINGS, JSON.stringify(saved));
  sessionStorage.setItem(KEY, $("set-key").value);
}

function headers() {
  const key = $("set-key").value.trim();
  const out = { "content-type": "application/json" };
  if (key) out.authorization = "Bearer " + key;
  return out;
}

function number(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestFields() {
  const speculation = { trace: true };
  const mode = $("set-mode").value;
  if (mode) speculation.mode = mode;
  const k = number("set-k"), w = number("set-w");
  if (k !== undefined) speculation.k = k;
  if (w !== undefined) speculation.w = w;
  if ($("set-strategy").value) speculation.strategy = $("set-strategy").value;
  const body = { stream: true, speculation, stream_options: { include_usage: true } };
  const temperature = number("set-temperature"), topP = number("set-top-p");
  const maxTokens = number("set-max-tokens");
  if (temperature !== undefined) body.temperature = temperature;
  if (topP !== undefined) body.top_p = topP;
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  return body;
}

// --- one answer: its tokens, rounds and strip chart -----------------------------------------
class Answer {
  constructor(container) {
    this.tokens = document.createElement("div");
    this.tokens.className = "tokens";
    this.chart = document.createElementNS(SVG, "svg");
    this.chart.setAttribute("class", "strip");
    this.chart.setAttribute("role", "img");
    this.chart.setAttribute("aria-label", "Tokens per pass and tokens per second, one point per round");
    container.append(this.tokens, this.chart);
    this.rounds = [];
    this.text = "";
  }

  addRound(trace) {
    this.rounds.push(trace);
    const index = this.rounds.length - 1;
    for (const token of trace.tokens) {
      const span = document.createElement("span");
      const drafted = token.source !== "model";
      span.className = "tok" + (drafted ? " drafted " + sourceClass(token.source) : "");
      span.dataset.source = token.source;
      span.dataset.round = String(index);
      span.tabIndex = 0;
      span.textContent = token.text;
      this.tokens.append(span);
      this.text += token.text;
    }
    this.drawChart();
  }

  addText(text) { // a chunk without a trace (another server): plain text
    this.tokens.append(document.createTextNode(text));
    this.text += text;
  }

  drawChart() {
    const width = 300, height = 80, pad = 14;
    const rounds = this.rounds;
    const tpp = rounds.map((r) => r.committed), tps = rounds.map((r) => r.realized_tokens_per_second);
    const maxTpp = Math.max(1, ...tpp), maxTps = Math.max(1e-9, ...tps);
    const x = (i) => pad + (rounds.length < 2 ? 0 : (i * (width - 2 * pad)) / (rounds.length - 1));
    const y = (value, max) => height - pad - (value / max) * (height - 2 * pad);
    this.chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
    this.chart.replaceChildren();
    const add = (name, attributes, text) => {
      const node = document.createElementNS(SVG, name);
      for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
      if (text !== undefined) node.textContent = text;
      this.chart.append(node);
      return node;
    };
    add("line", { class: "axis", x1: pad, x2: width - pad, y1: height - pad, y2: height - pad });
    add("text", { x: pad, y: 10 }, `tokens/pass (max ${maxTpp})`);
    add("text", { x: width - pad, y: 10, "text-anchor": "end" }, `tokens/s (max ${maxTps.toFixed(1)}), dashed`);
    add("polyline", { class: "line-tpp", points: tpp.map((v, i) => `${x(i)},${y(v, maxTpp)}`).join(" ") });
    add("polyline", { class: "line-tps", points: tps.map((v, i) => `${x(i)},${y(v, maxTps)}`).join(" ") });
    tpp.forEach((v, i) => {
      add("circle", { class: "pt-tpp", cx: x(i), cy: y(v, maxTpp), r: 2.2, "data-round": i })
        .append(titled(`round ${i}: ${v} tokens`));
    });
    tps.forEach((v, i) => {
      add("circle", { class: "pt-tps", cx: x(i), cy: y(v, maxTps), r: 1.6, "data-round": i })
        .append(titled(`round ${i}: ${v.toFixed(1)} tokens/s`));
    });
  }

  describe(index) {
    const r = this.rounds[index];
    if (!r) return "";
    const shape = r.k ? `k ${r.k} × w ${r.w}` : "plain";
    const forecast = r.forecast_tokens_per_second == null ? "no forecast" : `forecast ${r.forecast_tokens_per_second.toFixed(1)} tokens/s`;
    return `Pass ${r.round + 1}: ${shape}, tree ${r.tree_size} nodes, ${r.committed} tokens committed ` +
      `(${r.accepted} drafted accepted); ${forecast}, got ${r.realized_tokens_per_second.toFixed(1)} tokens/s.`;
  }
}

function titled(text) {
  const title = document.createElementNS(SVG, "title");
  title.textContent = text;
  return title;
}

// a token under the pointer, focus or a tap: its round in the info line
const answers = new WeakMap();
function showRound(event) {
  const span = event.target.closest && event.target.closest(".tok");
  if (!span) return;
  const answer = answers.get(span.parentElement);
  if (!answer) return;
  document.querySelectorAll(".tok.current").forEach((node) => node.classList.remove("current"));
  span.classList.add("current");
  const source = span.dataset.source === "model" ? "the model's own token" : `drafted by ${span.dataset.source}`;
  $("round-info").textContent = `“${span.textContent}”: ${source}. ${answer.describe(Number(span.dataset.round))}`;
}
for (const type of ["mouseover", "focusin", "click"]) document.addEventListener(type, showRound);

// --- streaming ----------------------------------------------------------------------------
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (error) {
    return response.statusText;
  }
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// run one streamed request into `answer`; resolves to its text
async function run(route, body, answer, controls) {
  const controller = new AbortController();
  controls.send.disabled = true;
  controls.stop.disabled = false;
  controls.stop.onclick = () => controller.abort();
  showError("");
  try {
    const response = await fetch(route, { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) {
      showError(`${response.status}: ${await errorText(response)}`);
      return answer.text;
    }
    for await (const chunk of events(response)) {
      if (chunk.error) { showError(chunk.error.message); break; }
      if (chunk.speculation_trace) { answer.addRound(chunk.speculation_trace); continue; }
      const choice = chunk.choices && chunk.choices[0];
      const text = choice && (choice.text || (choice.delta && choice.delta.content));
      // untraced text (a server without the extension): plain; traced, the rounds hold it all
      if (text && answer.rounds.length === 0) answer.addText(text);
    }
  } catch (error) {
    if (error.name !== "AbortError") showError(String(error));
  } finally {
    controls.send.disabled = false;
    controls.stop.disabled = true;
    answer.tokens.closest(".msg, #completion-out").dataset.done = "true";
  }
  return answer.text;
}

// --- chat --------------------------------------------------------------------------------
let history = [];

function message(role, text) {
  const item = document.createElement("li");
  item.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  item.append(who);
  if (text !== undefined) item.append(document.createTextNode(text));
  $("chat-log").append(item);
  return item;
}

async function sendChat(event) {
  event.preventDefault();
  const content = $("chat-input").value;
  if (!content.trim()) return;
  $("chat-input").value = "";
  history.push({ role: "user", content });
  message("user", content);
  const item = message("assistant");
  const answer = new Answer(item);
  answers.set(answer.tokens, answer);
  const text = await run("/v1/chat/completions", { ...requestFields(), messages: history }, answer,
    { send: $("chat-send"), stop: $("chat-stop") });
  history.push({ role: "assistant", content: text });
}

async function sendCompletion(event) {
  event.preventDefault();
  const out = $("completion-out");
  out.replaceChildren();
  delete out.dataset.done;
  const answer = new Answer(out);
  answers.set(answer.tokens, answer);
  await run("/v1/completions", { ...requestFields(), prompt: $("completion-input").value }, answer,
    { send: $("completion-send"), stop: $("completion-stop") });
}

// --- tabs (arrow keys move between them, as WAI-ARIA's tabs pattern) ------------------------
function selectTab(tab) {
  for (const other of document.querySelectorAll("[role=tab]")) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(other.getAttribute("aria-controls")).hidden = !selected;
  }
  tab.focus();
}

// --- the live server panel -----------------------------------------------------------------
function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    td.textContent = cell;
    tr.append(td);
  }
  return tr;
}

function drawHeatmap(heatmap) {
  const figure = $("heatmap");
  figure.querySelectorAll("svg, p").forEach((node) => node.remove());
  if (!heatmap) {
    const note = document.createElement("p");
    note.textContent = "No cost profile yet.";
    figure.append(note);
    return;
  }
  const cell = 18, left = 16, top = 4;
  const svg = document.createElementNS(SVG, "svg");
  const width = left + heatmap.k.length * cell, height = top + heatmap.w.length * cell + 14;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `Pass slowdown for k 1 to ${heatmap.k.length} and w 1 to ${heatmap.w.length} at context ${heatmap.context_length}`);
  const max = Math.max(...heatmap.slowdown.flat());
  const min = Math.min(...heatmap.slowdown.flat());
  const node = (name, attributes, text) => {
    const element = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
    if (text !== undefined) element.textContent = text;
    svg.append(element);
    return element;
  };
  heatmap.slowdown.forEach((values, wi) => {
    const y = top + (heatmap.w.length - 1 - wi) * cell; // w grows upwards
    node("text", { x: 2, y: y + cell / 2 + 2 }, String(heatmap.w[wi]));
    values.forEach((value, ki) => {
      const share = max > min ? (value - min) / (max - min) : 0;
      const light = Math.round(95 - share * 60); // one hue, light to dark: no colour needed to read it
      const rect = node("rect", { class: "heat", x: left + ki * cell, y, width: cell - 1, height: cell - 1, fill: `hsl(205 70% ${light}%)` });
      rect.append(titled(`k ${heatmap.k[ki]}, w ${heatmap.w[wi]}: ${value.toFixed(2)}×`));
      node("text", { x: left + ki * cell + cell / 2, y: y + cell / 2 + 2, "text-anchor": "middle", fill: light < 60 ? "#fff" : "#000" }, value.toFixed(1));
    });
  });
  heatmap.k.forEach((k, ki) => node("text", { x: left + ki * cell + cell / 2, y: height - 3, "text-anchor": "middle" }, String(k)));
  figure.append(svg);
}

let strategiesShown = false;
async function pollStatus() {
  if (document.hidden) return;
  let response;
  try {
    response = await fetch("/v1/speculation/status", { headers: headers() });
  } catch (error) {
    $("server-state").textContent = "The server does not answer.";
    return;
  }
  if (response.status === 401) {
    $("server-state").textContent = "The server asks for an API key (Settings).";
    return;
  }
  if (!response.ok) {
    $("server-state").textContent = response.status === 503 ? "The model is loading…" : `Status: ${response.status}`;
    return;
  }
  const status = await response.json();
  $("model-name").textContent = status.model;
  $("server-state").textContent = `Defaults: ${status.defaults.mode}, k ${status.defaults.k}, w ${status.defaults.w}, ${status.defaults.strategy}`;
  const load = [["running", status.requests_running], ["waiting", status.requests_waiting], ["tokens/s", status.tokens_per_second.toFixed(1)]];
  $("server-load").replaceChildren(...load.flatMap(([name, value]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = String(value);
    return [dt, dd];
  }));
  $("acceptance").tBodies[0].replaceChildren(...status.acceptance.map((a) =>
    row([a.strategy, a.drafted, a.accepted, (100 * a.rate).toFixed(0) + "%"])));
  const profile = status.cost_profile;
  let text = profile.in_use ? `Cost profile in use (${profile.source}).` : "No cost profile: auto mode decodes plainly.";
  if (profile.state) {
    text += profile.state.stale ? " Stale." : "";
    text += profile.state.remeasuring ? " Re-measuring." : "";
  }
  $("profile-state").textContent = text;
  drawHeatmap(status.heatmap);
  if (!strategiesShown) {
    strategiesShown = true;
    const select = $("set-strategy"), chosen = select.value;
    for (const name of status.defaults.strategies) select.append(new Option(name, name));
    select.value = chosen;
  }
}

// --- wiring --------------------------------------------------------------------------------
function legend() {
  $("legend").replaceChildren(...LEGEND.map(([source, label]) => {
    const span = document.createElement("span");
    span.className = "tok" + (source === "model" ? "" : " drafted " + sourceClass(source));
    span.textContent = label;
    return span;
  }));
}

function start() {
  loadSettings();
  legend();
  $("settings").addEventListener("input", saveSettings);
  $("set-key").addEventListener("change", pollStatus); // a key entered: the panel at once
  $("chat-form").addEventListener("submit", sendChat);
  $("completion-form").addEventListener("submit", sendCompletion);
  $("chat-clear").addEventListener("click", () => { history = []; $("chat-log").replaceChildren(); });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("chat-form").requestSubmit(); }
  });
  const tabs = [...document.querySelectorAll("[role=tab]")];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (step) selectTab(tabs[(i + step + tabs.length) % tabs.length]);
    });
  });
  pollStatus();
  setInterval(pollStatus, STATUS_EVERY_MS);
}

start();
