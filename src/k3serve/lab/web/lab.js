// The lab page: lists the modules from api/modules, runs one through the queue (POST, then poll the job),
// shows progress with a Cancel, and draws the result: metrics against the baseline and one chart per figure,
// each with its "measured on this machine" / "simulated (model)" mark and the command that reproduces it.
// The queue panel lists the running and queued jobs (api/jobs) with a Cancel each; a page loaded while jobs are
// queued or running (a reload, another tab) re-attaches each module to its job.
// Charts: one titled unit per axis, linear axes from 0, legends above the plot, the chosen policy in the accent
// colour, a text table behind each, numbers in human units (labFormat). A permalink per module fills its form from
// the URL; a result downloads as JSON or CSV; a module run again with other parameters shows the previous run
// dashed. The machine profile (price per hour, watts; localStorage) puts $ per million tokens and J/token beside
// every tok/s. The overview on top (api/overview) gives the answers first: headline figures and every module's
// verdict, from the stored runs until a run here replaces them; Run all queues every module at its defaults.
"use strict";

const POLL_MS = 300;
const QUEUE_POLL_MS = 1000;
// module id -> {module, job, following, last}: `following` is the job id being polled, if any; `last` the result
// shown now, whose figures become the dashed "previous run" when the module runs again with other parameters
const state = {};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

// Numbers in human units, never "2.349e+9": bytes as kB/MB/GB/TB, big counts in words, ratios as "495,000x" or
// "<0.01x". Exposed as window.labFormat so the browser test can check the rules.
const SIZE_UNITS = ["bytes", "kB", "MB", "GB", "TB", "PB"];
const WORDS = [[1e12, "trillion"], [1e9, "billion"], [1e6, "million"]];

function plain(value, digits) {
  // at most `digits` significant digits, thousands separated, no exponent whatever the size
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (abs < 1e-6) return value > 0 ? "<0.000001" : ">-0.000001";
  if (abs >= 10 ** digits) return Math.round(value).toLocaleString("en-US");
  return value.toLocaleString("en-US", {maximumSignificantDigits: digits});
}

function formatBytes(value) {
  let scaled = value, unit = 0;
  while (Math.abs(scaled) >= 1000 && unit < SIZE_UNITS.length - 1) { scaled /= 1000; unit += 1; }
  return `${plain(scaled, 3)} ${SIZE_UNITS[unit]}`;
}

function formatNumber(value, label) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "n/a";
  const text = label || "";
  // a value in raw bytes ("expert bytes read per token"); not one already in a size unit ("(MiB)"), nor a ratio of
  // bytes ("active / resident bytes")
  if (/\bbytes\b/i.test(text) && !/\((K|M|G|T)i?B\b/.test(text) && !text.includes("/")) return formatBytes(value);
  const abs = Math.abs(value);
  for (const [size, word] of WORDS) if (abs >= size) return `${plain(value / size, 3)} ${word}`;
  return plain(value, Number.isInteger(value) ? 7 : 4);
}

function formatRatio(ratio) {
  if (ratio === null || ratio === undefined || !Number.isFinite(ratio)) return "";
  if (ratio === 0) return "0x";
  if (Math.abs(ratio) < 0.01) return "<0.01x";
  if (Math.abs(ratio) >= 100) return `${Number(ratio.toPrecision(3)).toLocaleString("en-US")}x`;
  return `${ratio.toFixed(Math.abs(ratio) >= 10 ? 1 : 2)}x`;
}

window.labFormat = {number: formatNumber, bytes: formatBytes, ratio: formatRatio};

// Cost and energy of a throughput on a machine profile (price per hour, power draw):
//   dollars per million tokens = price_per_hour / (tok/s x 3600 s/h) x 1e6;  joules per token = watts / (tok/s)
const DEFAULT_PROFILE = {pricePerHour: 0.10, watts: 65};  // a small 2-core cloud VM and its share of a server
const PROFILE_KEY = "k3serve-lab-profile";

function costOf(tokPerSecond, profile) {
  if (!(tokPerSecond > 0)) return null;
  return {dollarsPerMillion: profile.pricePerHour / (tokPerSecond * 3600) * 1e6,
          joulesPerToken: profile.watts / tokPerSecond};
}

function loadProfile() {
  try {
    const saved = JSON.parse(localStorage.getItem(PROFILE_KEY) || "null");
    if (saved && saved.pricePerHour >= 0 && saved.watts >= 0) return saved;
  } catch (exc) { /* a malformed entry: fall back to the defaults */ }
  return {...DEFAULT_PROFILE};
}

function costText(tokPerSecond, profile) {
  const cost = costOf(tokPerSecond, profile);
  if (cost === null) return "";
  return `$${plain(cost.dollarsPerMillion, 3)} per million tokens, ${plain(cost.joulesPerToken, 3)} J/token`;
}

function isThroughput(label) {
  return /tok\/s|tokens per second/i.test(label || "");
}

function costSpan(tokPerSecond) {
  return el("span", {class: "cost", "data-tok-per-s": String(tokPerSecond), text: costText(tokPerSecond, loadProfile())});
}

function refreshCosts() {
  const profile = loadProfile();
  for (const span of document.querySelectorAll(".cost[data-tok-per-s]")) {
    span.textContent = costText(Number(span.dataset.tokPerS), profile);
  }
}

function setUpProfile() {
  const price = document.getElementById("price-per-hour");
  const watts = document.getElementById("watts");
  document.getElementById("profile-defaults").textContent =
    `$${DEFAULT_PROFILE.pricePerHour.toFixed(2)} per hour, ${DEFAULT_PROFILE.watts} W`;
  const show = (profile) => { price.value = String(profile.pricePerHour); watts.value = String(profile.watts); };
  show(loadProfile());
  const save = () => {
    const profile = {pricePerHour: Number(price.value), watts: Number(watts.value)};
    if (price.value === "" || watts.value === "" || !(profile.pricePerHour >= 0) || !(profile.watts >= 0)) return;
    localStorage.setItem(PROFILE_KEY, JSON.stringify(profile));
    refreshCosts();
  };
  price.addEventListener("input", save);
  watts.addEventListener("input", save);
  document.getElementById("profile-reset").addEventListener("click", () => {
    localStorage.removeItem(PROFILE_KEY);
    show(DEFAULT_PROFILE);
    refreshCosts();
  });
}

window.labCost = {costOf, costText, defaults: DEFAULT_PROFILE};

function paramInput(moduleId, param) {
  const id = `p-${moduleId}-${param.name}`;
  let input;
  if (param.type === "choice") {
    input = el("select", {id, name: param.name, "data-param": param.name});
    for (const choice of param.choices) input.append(el("option", {value: choice, text: choice}));
    input.value = param.default;
  } else if (param.type === "bool") {
    input = el("input", {id, name: param.name, type: "checkbox", "data-param": param.name});
    input.checked = !!param.default;
  } else {
    input = el("input", {id, name: param.name, type: "number", "data-param": param.name,
                         step: param.type === "int" ? "1" : "any", value: String(param.default)});
    if (param.min !== null) input.min = String(param.min);
    if (param.max !== null) input.max = String(param.max);
  }
  const range = param.choices ? "" : (param.min !== null && param.max !== null ? ` [${param.min}..${param.max}]` : "");
  const label = el("label", {for: id, title: param.help || ""},
                   `${param.name}${param.unit ? " (" + param.unit + ")" : ""}${range}`, input);
  return label;
}

function readParams(section, module) {
  const params = {};
  for (const param of module.params) {
    const input = section.querySelector(`[data-param="${param.name}"]`);
    input.classList.remove("bad");
    if (param.type === "bool") params[param.name] = input.checked;
    else if (param.type === "choice") params[param.name] = input.value;
    else params[param.name] = input.value === "" ? input.value : Number(input.value);
  }
  return params;
}

function defaults(module) {
  return Object.fromEntries(module.params.map((p) => [p.name, p.default]));
}

function permalink(id, params) {
  // ?module=ID&name=value...: opening it fills that module's form (nothing runs until Run)
  const query = new URLSearchParams({module: id});
  for (const [name, value] of Object.entries(params)) query.set(name, String(value));
  return `${location.pathname}?${query}#m-${id}`;
}

function fillForm(section, params) {
  for (const [name, value] of Object.entries(params)) {
    const input = section.querySelector(`[data-param="${name}"]`);
    if (!input) continue;
    if (input.type === "checkbox") input.checked = value === true || value === "true";
    else input.value = String(value);
  }
}

function openPermalink() {
  const query = new URLSearchParams(location.search);
  const id = query.get("module");
  if (!id || !state[id]) return;
  query.delete("module");
  const section = document.getElementById(`m-${id}`);
  fillForm(section, Object.fromEntries(query));
  section.querySelector('[data-role="permalink"]').href = permalink(id, readParams(section, state[id].module));
  section.scrollIntoView();
}

function renderModule(module) {
  const section = el("section", {class: "module", id: `m-${module.id}`, "data-module": module.id});
  const kinds = {measured: "measured on this machine", simulated: "simulated (model)",
                 both: "measured and simulated figures"};
  section.append(
    el("h2", {}, el("span", {class: "num", text: `${module.number}.`}), module.title,
       el("span", {class: "kind", text: kinds[module.kind] || module.kind})),
    el("p", {class: "summary", text: module.summary}),
    el("p", {class: "explanation", text: module.explanation}),
    el("p", {class: "latest", "data-role": "latest", "aria-live": "polite"}));
  const form = el("form", {class: "params", onsubmit: (e) => { e.preventDefault(); run(module.id, false); },
                           // Enter in any field runs the module (a form without a submit button would not submit)
                           onkeydown: (e) => {
                             if (e.key !== "Enter" || e.target.tagName !== "INPUT") return;
                             e.preventDefault();
                             if (state[module.id].following === null) run(module.id, false);
                           }});
  for (const param of module.params) form.append(paramInput(module.id, param));
  section.append(form);
  const runButton = el("button", {class: "run", type: "button", "data-action": "run", text: "Run",
                                  onclick: () => run(module.id, false)});
  const rerunButton = el("button", {class: "rerun-button", type: "button", "data-action": "rerun",
                                    text: "Measure again", title: "ignore the cached result for these parameters",
                                    onclick: () => run(module.id, true)});
  const cancelButton = el("button", {class: "cancel", type: "button", "data-action": "cancel", text: "Cancel",
                                     disabled: "", onclick: () => cancel(module.id)});
  const bar = el("div", {class: "progress", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100"},
                 el("div"));
  const link = el("a", {class: "permalink", "data-role": "permalink", href: permalink(module.id, defaults(module)),
                        title: "a link that opens this page with these parameters in the form",
                        text: "link to these parameters"});
  form.addEventListener("input", () => { link.href = permalink(module.id, readParams(section, module)); });
  form.addEventListener("change", () => { link.href = permalink(module.id, readParams(section, module)); });
  section.append(el("div", {class: "controls"}, runButton, rerunButton, cancelButton, link, bar,
                    el("span", {class: "message", "data-role": "message", role: "status", "aria-live": "polite"})));
  section.append(el("div", {class: "error", "data-role": "error", role: "alert", "aria-live": "assertive"}));
  section.append(el("div", {class: "result", "data-role": "result", "aria-live": "polite"}));
  return section;
}

function setRunning(id, running) {
  const section = document.getElementById(`m-${id}`);
  section.querySelector('[data-action="run"]').disabled = running;
  section.querySelector('[data-action="rerun"]').disabled = running;
  section.querySelector('[data-action="cancel"]').disabled = !running;
  section.dataset.state = running ? "running" : "idle";
}

function showProgress(id, job) {
  const section = document.getElementById(`m-${id}`);
  const pct = Math.round(100 * (job.progress || 0));
  section.querySelector(".progress > div").style.width = `${pct}%`;
  section.querySelector(".progress").setAttribute("aria-valuenow", String(pct));
  let text = job.message || job.status;
  if (job.status === "queued") text = `queued, position ${job.position}`;
  else if (job.status === "running") text = `${pct}% ${job.message}`;
  section.querySelector('[data-role="message"]').textContent = text;
}

async function run(id, rerun) {
  const section = document.getElementById(`m-${id}`);
  return submit(id, readParams(section, state[id].module), rerun, false);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function roomInQueue(section) {
  // Run all queues more modules than the queue holds: wait until a place is free before each POST, so that none is
  // refused (a refused request is an error in the browser's console, and Run all is not an error)
  for (;;) {
    const listing = await (await fetch("api/jobs")).json();
    if (listing.jobs.filter((job) => job.position > 0).length < listing.max_queued) return;
    section.querySelector('[data-role="message"]').textContent = "waiting for room in the queue";
    await sleep(QUEUE_POLL_MS);
  }
}

async function submit(id, params, rerun, waitForRoom) {
  // POST one run and follow its job; `waitForRoom` (Run all): a full queue is waited out, not reported (a 429 that
  // still comes, from another page filling the queue first, is retried)
  const entry = state[id];
  const section = document.getElementById(`m-${id}`);
  const error = section.querySelector('[data-role="error"]');
  error.textContent = "";
  setRunning(id, true);
  entry.following = "pending";  // the queue panel's poll must not attach to the job this POST creates
  let response, body;
  try {
    for (;;) {
      if (waitForRoom) await roomInQueue(section);
      response = await fetch(`api/modules/${id}/run${rerun ? "?rerun=true" : ""}`, {
        method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(params)});
      body = await response.json();
      if (!(waitForRoom && response.status === 429)) break;
      section.querySelector('[data-role="message"]').textContent = "waiting for room in the queue";
      await sleep(QUEUE_POLL_MS);
    }
  } catch (exc) {
    error.textContent = `the server did not answer: ${exc}`;
    entry.following = null;
    setRunning(id, false);
    return;
  }
  if (!response.ok) {
    const message = body.error ? body.error.message : response.statusText;
    error.textContent = message;
    if (body.error && body.error.param) {
      const input = section.querySelector(`[data-param="${body.error.param}"]`);
      if (input) input.classList.add("bad");
    }
    entry.following = null;
    setRunning(id, false);
    return;
  }
  entry.job = body.job_id;
  follow(id, body);
  return true;
}

async function runAll() {
  // every module at its defaults, queued in page order (a module already following a job keeps it)
  const button = document.getElementById("run-all");
  const status = document.getElementById("run-all-status");
  button.disabled = true;
  let queued = 0;
  const ids = Object.keys(state);
  for (const id of ids) {
    if (state[id].following !== null && state[id].following !== undefined) continue;
    const params = defaults(state[id].module);
    fillForm(document.getElementById(`m-${id}`), params);
    status.textContent = `queueing ${queued + 1} of ${ids.length}: ${state[id].module.title}`;
    if (await submit(id, params, false, true)) queued += 1;
  }
  status.textContent = `${queued} modules queued at their defaults; each shows its result and verdict when done.`;
  button.disabled = false;
}

function follow(id, job) {
  const entry = state[id];
  showProgress(id, job);
  if (job.status === "queued" || job.status === "running") {
    entry.following = job.job_id;
    setTimeout(async () => {
      try {
        const response = await fetch(`api/jobs/${job.job_id}`);
        follow(id, await response.json());
      } catch (exc) {
        document.querySelector(`#m-${id} [data-role="error"]`).textContent = `lost the job: ${exc}`;
        entry.following = null;
        setRunning(id, false);
      }
    }, POLL_MS);
    return;
  }
  entry.following = null;
  setRunning(id, false);
  const section = document.getElementById(`m-${id}`);
  if (job.status === "done") {
    renderResult(id, job.result, job.cached, job.job_id);
    refreshOverview();
  } else if (job.status === "failed") {
    section.querySelector('[data-role="error"]').textContent = `the run failed: ${job.error}`;
  } else if (job.status === "cancelled") {
    section.querySelector('[data-role="message"]').textContent = job.message;
  }
}

async function cancel(id) {
  const entry = state[id];
  if (!entry.job) return;
  await fetch(`api/jobs/${entry.job}`, {method: "DELETE"});
}

function attach(job) {
  // follow a queued or running job this page did not start (or started before a reload), showing its parameters
  const entry = state[job.module];
  if (!entry || entry.following) return;
  fillForm(document.getElementById(`m-${job.module}`), job.params);
  entry.job = job.job_id;
  setRunning(job.module, true);
  follow(job.module, job);
}

function renderQueue(jobs) {
  const list = document.getElementById("queue-jobs");
  list.innerHTML = "";
  document.getElementById("queue").dataset.count = String(jobs.length);
  if (!jobs.length) {
    list.append(el("li", {class: "empty", text: "nothing queued or running"}));
    return;
  }
  for (const job of jobs) {
    const where = job.status === "running" ? `running, ${Math.round(100 * job.progress)}%`
                                           : `queued, position ${job.position}`;
    const title = state[job.module] ? state[job.module].module.title : job.module;
    list.append(el("li", {"data-job": job.job_id, "data-status": job.status},
      el("a", {href: `#m-${job.module}`, text: title}), el("span", {class: "where", text: where}),
      el("button", {class: "cancel", type: "button", "data-action": "cancel-job", text: "Cancel",
                    onclick: () => fetch(`api/jobs/${job.job_id}`, {method: "DELETE"}).then(refreshQueue)})));
  }
}

async function refreshQueue() {
  let jobs;
  try {
    jobs = (await (await fetch("api/jobs")).json()).jobs;
  } catch (exc) {
    return;  // the server is away for a moment; the next poll tries again
  }
  for (const job of jobs) attach(job);
  renderQueue(jobs);
}

async function watchQueue() {
  await refreshQueue();
  setTimeout(watchQueue, QUEUE_POLL_MS);
}

function changeCell(metric, baseline) {
  if (metric === null || baseline === null || baseline === 0 || metric === undefined || baseline === undefined) {
    return el("td", {text: ""});
  }
  return el("td", {class: "ratio", text: formatRatio(metric / baseline)});
}

function changedParams(before, after) {
  return Object.keys(after).filter((k) => JSON.stringify(before[k]) !== JSON.stringify(after[k]))
    .map((k) => `${k}=${before[k]}`).join(", ");
}

function renderResult(id, result, cached, jobId) {
  const entry = state[id];
  const previous = entry.last && changedParams(entry.last.params, result.params) ? entry.last : null;
  entry.last = result;
  const section = document.getElementById(`m-${id}`);
  section.querySelector('[data-role="permalink"]').href = permalink(id, result.params);
  const target = section.querySelector('[data-role="result"]');
  target.innerHTML = "";
  const table = el("table", {class: "metrics", "data-role": "metrics"});
  table.append(el("thead", {}, el("tr", {}, el("th", {text: "metric"}), el("th", {text: result.metrics_name}),
                                  el("th", {text: result.baseline_name}), el("th", {text: "ratio"}))));
  const tbody = el("tbody");
  for (const [key, value] of Object.entries(result.metrics)) {
    const base = key in result.baseline ? result.baseline[key] : null;
    const label = result.labels[key] || key;
    const cell = (number, cls) => {
      const td = el("td", {class: cls, text: formatNumber(number, label)});
      if (cls === "value") td.dataset.value = String(number);
      if (isThroughput(label) && number > 0) td.append(el("br"), costSpan(number));  // cost beside the throughput
      return td;
    };
    tbody.append(el("tr", {"data-metric": key}, el("td", {text: label}), cell(value, "value"),
                    cell(base, "baseline"), changeCell(value, base)));
  }
  table.append(tbody);
  target.append(el("div", {class: "table-wrap"}, table));
  if (result.verdict) target.append(verdictLine(result.verdict, "Verdict: "));
  if (result.notes && result.notes.length) {
    const notes = el("ul", {class: "notes"});
    for (const note of result.notes) notes.append(el("li", {text: note}));
    target.append(notes);
  }
  const figures = el("div", {class: "figures"});
  target.append(figures);
  const pending = [];  // draw once every box is in the grid, so each chart takes its final cell width
  const changed = previous ? changedParams(previous.params, result.params) : "";
  result.series.forEach((figure, index) => {
    const before = previous && previous.series[index];
    const overlay = before && before.kind === figure.kind && figure.kind !== "heatmap" &&
      before.y_label === figure.y_label ? before : null;
    const chart = el("div", {class: "chart", id: `chart-${id}-${index}`});
    const box = el("div", {class: "figure", "data-measured": String(figure.measured)},
      el("div", {class: "head"}, el("span", {class: "title", text: figure.title}),
         el("span", {class: `mark ${figure.measured ? "measured" : "simulated"}`, text: figure.mark})),
      chart,
      dataTable(figure),
      el("div", {class: "source", text: figure.source}),
      el("div", {class: "command"}, "reproduce: ", el("code", {text: figure.command})));
    figures.append(box);
    pending.push([chart, figure, overlay, changed]);
  });
  for (const [chart, figure, overlay, changed] of pending) draw(chart, figure, overlay, changed);
  const related = result.related_commands && result.related_commands.length
    ? ` Related: ${result.related_commands.join("  |  ")}` : "";
  target.append(el("p", {class: "meta", text: `${cached ? "cached result, " : ""}ran in ${result.seconds} s.` +
                                                 related}));
  if (jobId) {
    target.append(el("p", {class: "export"}, "Download this result: ",
      el("a", {href: `api/jobs/${jobId}/result.json`, download: `${id}-${jobId}.json`, "data-role": "export-json",
               text: "JSON"}), ", ",
      el("a", {href: `api/jobs/${jobId}/result.csv`, download: `${id}-${jobId}.csv`, "data-role": "export-csv",
               text: "CSV"}),
      previous ? ` Dashed: the previous run (${changed}).` : ""));
  }
}

function verdictLine(verdict, prefix) {
  // one generated sentence: won / lost / even, by how much, and when it would flip
  return el("p", {class: `verdict ${verdict.outcome}`, "data-role": "verdict", "data-outcome": verdict.outcome,
                  "data-metric": verdict.metric},
            el("b", {text: prefix}), verdict.sentence);
}

// ---- the answers-first overview: headline figures and every module's verdict (api/overview) -------------------
const BADGES = {measured: "measured on this machine", recorded: "recorded (measured earlier)",
                simulated: "simulated (model)"};

function badge(name) {
  return el("span", {class: `mark ${name === "simulated" ? "simulated" : "measured"} badge-${name}`,
                     "data-badge": name, text: BADGES[name] || name});
}

function whenText(entry) {
  const day = entry.date ? entry.date.replace("T", " ").replace("+00:00", " UTC") : "date unknown";
  const from = entry.source === "stored run" ? "stored run" : "run here";
  // a run that shows a record instead of measuring (peers without llama.cpp): the record's date, its source line
  // names the machine
  if (entry.recorded) return `recorded ${day} (shown by a ${from}; the module's source line names the machine)`;
  return `${from}, ${day}${entry.machine ? ", " + entry.machine : ""}`;
}

function figureText(entry) {
  if (entry.text) return entry.text;
  const value = formatNumber(entry.value, entry.label);
  const base = entry.baseline === null || entry.baseline === undefined ? "" :
    ` vs ${formatNumber(entry.baseline, entry.label)} (${entry.baseline_name})`;
  return `${entry.label}: ${value} (${entry.metrics_name})${base}`;
}

function moduleLink(id, text) {
  return state[id] ? el("a", {href: `#m-${id}`, "data-role": "module-link", text}) : el("span", {text});
}

function renderOverview(data) {
  const meta = document.getElementById("overview-meta");
  const stored = data.stored;
  meta.textContent = stored.date
    ? `Figures from the stored runs of ${stored.date.slice(0, 10)} on ${stored.machine} (${stored.command}, every ` +
      `module at its defaults); a run made here replaces its module's figure and carries its own date.`
    : "No stored runs ship with this install: every figure says \"not yet run\" until its module runs here.";
  if (stored.error) meta.textContent += ` (${stored.error})`;
  const cards = document.getElementById("headlines");
  cards.innerHTML = "";
  for (const entry of data.headlines) {
    const card = el("div", {class: "headline", "data-slot": entry.slot, "data-status": entry.status},
                    el("h3", {text: entry.title}));
    if (entry.status !== "done") {
      card.append(el("p", {class: "figure-text", "data-role": "figure", text: "not yet run"}),
                  el("p", {class: "when", text: state[entry.module]
                    ? `module ${entry.module}: press Run there, or Run all` :
                    `module ${entry.module} is not part of this install`}));
    } else {
      card.append(el("p", {class: "figure-text", "data-role": "figure", text: figureText(entry)}));
      if (entry.verdict) card.append(verdictLine(entry.verdict, ""));
      card.append(el("p", {class: "when"}, badge(entry.badge), " ", whenText(entry), " ",
                     moduleLink(entry.module, `module: ${entry.module_title || entry.module}`)));
    }
    cards.append(card);
  }
  const list = document.getElementById("verdicts");
  list.innerHTML = "";
  for (const row of data.modules) {
    const item = el("li", {"data-module": row.module, "data-status": row.status},
                    moduleLink(row.module, `${row.number}. ${row.title}`));
    if (row.status !== "done") {
      item.append(" ", el("span", {class: "when", text: "not yet run"}));
    } else {
      if (row.verdict) {
        const factor = row.verdict.factor === null ? "" : ` ${formatRatio(row.verdict.factor)}`;
        item.append(" ", el("span", {class: `outcome ${row.verdict.outcome}`, text: `${row.verdict.outcome}${factor}`}));
      }
      item.append(" ", badge(row.badge), el("p", {class: "sentence", "data-role": "verdict",
                                                   text: row.verdict ? row.verdict.sentence : "no verdict"}),
                  el("span", {class: "when", text: whenText(row) +
                    (row.timing ? "; a timing: it moves with the machine and its load" : "")}));
    }
    list.append(item);
    const latest = document.querySelector(`#m-${row.module} [data-role="latest"]`);
    if (latest) {
      latest.innerHTML = "";
      if (row.status === "done" && row.verdict) {
        latest.append(el("b", {text: "Last run: "}), badge(row.badge), ` ${whenText(row)}. ${row.verdict.sentence}`);
      }
    }
  }
}

async function refreshOverview() {
  try {
    renderOverview(await (await fetch("api/overview")).json());
  } catch (exc) {
    document.getElementById("overview-meta").textContent = `cannot load the overview: ${exc}`;
  }
}

function dataTable(figure) {
  // the chart's numbers as text, for screen readers and for copying, formatted like the metrics table
  const table = el("table", {class: "data"});
  const body = el("tbody");
  if (figure.kind === "heatmap") {
    const trace = figure.traces[0];
    table.append(el("thead", {}, el("tr", {}, el("th", {text: `${figure.y_label} \\ ${figure.x_label}`}),
                                    ...trace.x.map((x) => el("th", {text: String(x)})))));
    trace.y.forEach((y, row) => body.append(el("tr", {}, el("th", {text: String(y)}),
      ...trace.z[row].map((v) => el("td", {text: formatNumber(v, trace.name)})))));
  } else {
    const xs = [];
    for (const trace of figure.traces) for (const x of trace.x) if (!xs.includes(x)) xs.push(x);
    table.append(el("thead", {}, el("tr", {}, el("th", {text: figure.x_label || ""}),
                                    ...figure.traces.map((t) => el("th", {text: `${t.name}, ${figure.y_label}`})))));
    for (const x of xs) {
      body.append(el("tr", {}, el("th", {text: typeof x === "number" ? formatNumber(x, figure.x_label) : String(x)}),
        ...figure.traces.map((t) => {
          const at = t.x.indexOf(x);
          const td = el("td", {text: at < 0 ? "" : formatNumber(t.y[at], figure.y_label)});
          if (at >= 0 && figure.y_unit === "tok/s" && t.y[at] > 0) td.append(el("br"), costSpan(t.y[at]));
          return td;
        })));
    }
  }
  table.append(body);
  return el("details", {class: "data-table"}, el("summary", {text: "the numbers behind this chart"}),
            el("div", {class: "table-wrap"}, table));
}

const HIGHLIGHT = "#2457c5";
const COLORWAY = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
const MUTED_BAR = "#a9b3c4";

function axisLayout(label, numeric, log) {
  // one titled unit per axis; a linear numeric axis starts at 0, a log one says so in its title
  const axis = {title: {text: log ? `${label}, log scale` : label, standoff: 6}, automargin: true,
                exponentformat: "none", separatethousands: true};
  if (log) axis.type = "log";
  else if (numeric) axis.rangemode = "tozero";
  return axis;
}

function drawTraces(figure) {
  const named = figure.traces.some((t) => t.name === figure.highlight);
  return figure.traces.map((t) => {
    if (figure.kind === "heatmap") {
      return {type: "heatmap", z: t.z, x: t.x, y: t.y, name: t.name, colorscale: "Viridis",
              colorbar: {title: {text: t.name, side: "right"}, thickness: 12}};
    }
    const chosen = figure.highlight !== null && figure.highlight !== undefined;
    if (figure.kind === "bar") {
      const trace = {type: "bar", x: t.x, y: t.y, name: t.name};
      if (chosen && !named && figure.traces.length === 1) {  // the chosen category in the accent colour
        trace.marker = {color: t.x.map((x) => (x === figure.highlight ? HIGHLIGHT : MUTED_BAR))};
      } else if (chosen && named) {
        trace.marker = {opacity: t.name === figure.highlight ? 1 : 0.45};
      }
      return trace;
    }
    const trace = {type: "scatter", mode: "lines+markers", x: t.x, y: t.y, name: t.name};
    if (chosen && named) {
      trace.line = {width: t.name === figure.highlight ? 4 : 1.5};
      if (t.name !== figure.highlight) trace.opacity = 0.6;
    }
    return trace;
  });
}

function previousTraces(figure, changed) {
  // the previous run of this module (other parameters) under the new one: dashed lines, hatched pale bars
  return figure.traces.map((t) => {
    const name = `${t.name} (previous: ${changed})`;
    if (figure.kind === "bar") {
      return {type: "bar", x: t.x, y: t.y, name, opacity: 0.45, marker: {pattern: {shape: "/"}}, "meta": "previous"};
    }
    return {type: "scatter", mode: "lines", x: t.x, y: t.y, name, line: {dash: "dash", width: 1.5},
            "meta": "previous"};
  });
}

function draw(div, figure, overlay, changed) {
  const current = drawTraces(figure);
  const before = overlay ? previousTraces(overlay, changed) : [];
  // a previous trace takes the colour of the current trace of its name (or place), dashed or hatched
  current.forEach((trace, i) => {
    const color = COLORWAY[i % COLORWAY.length];
    if (trace.type === "scatter") trace.line = Object.assign({color}, trace.line);
    else if (trace.type === "bar") trace.marker = Object.assign({color}, trace.marker);
  });
  before.forEach((trace, i) => {
    const match = overlay.traces[i].name;
    const at = figure.traces.findIndex((t) => t.name === match);
    const color = COLORWAY[(at < 0 ? i : at) % COLORWAY.length];
    if (trace.type === "scatter") trace.line.color = color;
    else trace.marker.color = color;
  });
  const traces = current.concat(before);
  const logX = figure.kind === "line" && figure.traces.length &&
    figure.traces[0].x.length > 2 && figure.traces[0].x[figure.traces[0].x.length - 1] / figure.traces[0].x[0] > 200;
  const numericX = figure.kind === "line";
  const style = getComputedStyle(document.body);
  const grid = style.getPropertyValue("--line").trim() || "#d9dee7";
  const layout = {margin: {l: 60, r: 10, t: 10, b: 40}, barmode: "group", showlegend: traces.length > 1,
                  // the legend sits above the plot, clear of both axis titles
                  legend: {orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom", font: {size: 11}},
                  font: {size: 11, color: style.color}, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
                  xaxis: axisLayout(figure.x_label, numericX, logX), yaxis: axisLayout(figure.y_label, true, figure.log_y)};
  for (const axis of [layout.xaxis, layout.yaxis]) Object.assign(axis, {gridcolor: grid, zerolinecolor: grid, linecolor: grid});
  if (figure.kind === "heatmap") {  // expert ids in a chosen order are categories, not numbers
    layout.xaxis.type = "category";
    layout.yaxis.type = "category";
    delete layout.xaxis.rangemode;
    delete layout.yaxis.rangemode;
  }
  if (div.clientWidth) layout.width = div.clientWidth;  // the grid cell's width, not plotly's 700 px default
  Plotly.newPlot(div, traces, layout, {displaylogo: false, responsive: true});
}

function fitCharts() {
  // a narrower window (a phone turned, a split screen) must not leave charts wider than their cells
  for (const div of document.querySelectorAll(".chart.js-plotly-plot")) {
    if (div.clientWidth && div._fullLayout && Math.abs(div._fullLayout.width - div.clientWidth) > 1) {
      Plotly.relayout(div, {width: div.clientWidth});
    }
  }
}

let fitTimer = null;
window.addEventListener("resize", () => { clearTimeout(fitTimer); fitTimer = setTimeout(fitCharts, 100); });

async function main() {
  setUpProfile();
  const status = document.getElementById("status");
  let modules;
  try {
    modules = await (await fetch("api/modules")).json();
  } catch (exc) {
    status.textContent = `cannot load the modules: ${exc}`;
    return;
  }
  const toc = document.getElementById("toc");
  const container = document.getElementById("modules");
  for (const module of modules) {
    state[module.id] = {module, job: null, following: null};
    toc.append(el("a", {href: `#m-${module.id}`, text: `${module.number}. ${module.title}`}));
    container.append(renderModule(module));
  }
  status.textContent = `${modules.length} modules. Nothing runs until you press Run (or Run all).`;
  document.getElementById("run-all").addEventListener("click", runAll);
  await refreshOverview();
  openPermalink();
  await refreshQueue();  // re-attach to jobs queued or running before this page was loaded
  document.body.dataset.ready = "true";
  setTimeout(watchQueue, QUEUE_POLL_MS);
}

main();
