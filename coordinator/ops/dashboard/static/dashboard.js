// fedbit dashboard: renders the coordinator's picture, kept live by server-sent events
// (/events: "snapshot" = everything, "update" = the picture plus the rounds completed since).
// Every value from the server is written with textContent (device ids come from devices).
"use strict";

(function () {
  // a fixed colour (colour-blind-safe: Okabe & Ito, then Tol) and dash per bitwidth group,
  // a colour per codec family: the same as the reports' plots (coordinator/emulation/plots.py)
  const GROUP_STYLES = {float32: ["#0072B2", []], int16: ["#009E73", [8, 4]], int12: ["#56B4E9", [8, 4]],
                        int8: ["#E69F00", [8, 3, 2, 3]], int6: ["#CC79A7", [2, 3]], int4: ["#D55E00", [5, 1]],
                        int2: ["#000000", [1, 1]]};
  const CODEC_COLOURS = {float32: "#0072B2", float16: "#56B4E9", int: "#E69F00", asym: "#009E73",
                         kmeans: "#D55E00", lloydmax: "#CC79A7", danuq: "#000000", ternary: "#F0E442",
                         lut: "#999933", affine: "#882255", fused: "#44AA99", mixed: "#999999"};
  const SPARE = ["#332288", "#882255", "#44AA99", "#999933", "#AA4499", "#117733", "#88CCEE", "#DDCC77"];

  function spare(name) {
    let h = 0;
    for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return SPARE[h % SPARE.length];
  }
  const groupStyle = (g) => GROUP_STYLES[g] || [spare(g), [4, 2]];
  const codecColour = (c) => CODEC_COLOURS[c.split("-")[0]] || spare(c);

  const $ = (id) => document.getElementById(id);
  let state = null;
  let rounds = [];
  let accChart = null, accKey = "";
  let bytesChart = null, bytesKey = "";
  const api = {history: [], latencies: [], updates: 0,
               accuracyPoints: () => (accChart ? accChart.data[0].length : 0),
               online: () => (state ? state.online : 0),
               rounds: () => rounds.length};
  window.fedbitDashboard = api;

  // ---------------------------------------------------------------- formatting
  const pct = (v) => (typeof v === "number" ? (100 * v).toFixed(1) + "%" : "n/a");
  const secs = (v) => (typeof v === "number" ? v.toFixed(v < 10 ? 2 : 1) + " s" : "n/a");
  function bytes(n) {
    if (typeof n !== "number") return "n/a";
    const u = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + u[i];
  }
  function ago(t) {
    if (!t) return "never";
    const d = Math.max(0, Date.now() / 1000 - t);
    if (d < 60) return Math.round(d) + " s ago";
    if (d < 3600) return Math.round(d / 60) + " min ago";
    return Math.round(d / 3600) + " h ago";
  }
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function facts(dl, pairs) {
    dl.replaceChildren();
    for (const [k, v] of pairs) { dl.append(el("dt", k), el("dd", v)); }
  }

  // ---------------------------------------------------------------- charts
  // rounds are whole numbers: ticks on integers only
  const ROUND_AXIS = {label: "round", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
                      values: (u, v) => v.map((x) => String(x))};
  function width(id) { return Math.max(300, $(id).clientWidth); }

  function drawAccuracy() {
    const groups = [...new Set(rounds.flatMap((r) => Object.keys(r.groups || {})))].sort(
      (a, b) => (a === "float32" ? -1 : b === "float32" ? 1 : a.localeCompare(b, "en", {numeric: true})));
    const data = [rounds.map((r) => r.round)];
    for (const g of groups) data.push(rounds.map((r) => (r.groups || {})[g] ?? null));
    const key = groups.join(",");
    if (!accChart || key !== accKey) {
      if (accChart) accChart.destroy();
      accKey = key;
      accChart = new uPlot({
        width: width("acc-chart"), height: 260, legend: {live: false},
        scales: {x: {time: false}, y: {range: [0, 1]}},
        axes: [ROUND_AXIS, {label: "test accuracy", values: (u, v) => v.map((x) => (100 * x).toFixed(0) + "%")}],
        series: [{label: "round"}, ...groups.map((g) => ({
          label: g, stroke: groupStyle(g)[0], dash: groupStyle(g)[1], width: 2, points: {show: true, size: 6},
          value: (u, v) => pct(v)}))],
      }, data, $("acc-chart"));
    } else {
      accChart.setData(data);
    }
    $("acc-caption").textContent = rounds.length ? `(${rounds.length} round${rounds.length > 1 ? "s" : ""}; ` +
      "each group's model as that group runs it, on the held-out set)" : "(no round completed yet)";
  }

  function drawBytes() {
    const codecs = [...new Set(rounds.flatMap((r) => Object.keys(r.uplink_bytes || {})))].sort();
    const data = [rounds.map((r) => r.round)];
    for (const c of codecs) data.push(rounds.map((r) => (r.uplink_bytes || {})[c] ?? 0));
    const key = codecs.join(",");
    if (!bytesChart || key !== bytesKey) {
      if (bytesChart) bytesChart.destroy();
      bytesKey = key;
      bytesChart = new uPlot({
        width: width("bytes-chart"), height: 220, legend: {live: false},
        scales: {x: {time: false}, y: {range: (u, lo, hi) => [0, Math.max(1, hi) * 1.1]}},
        axes: [ROUND_AXIS, {label: "bytes", size: 70, values: (u, v) => v.map(bytes)}],
        series: [{label: "round"}, ...codecs.map((c) => ({
          label: c, stroke: codecColour(c), width: 2, points: {show: true, size: 6},
          value: (u, v) => bytes(v)}))],
      }, data, $("bytes-chart"));
    } else {
      bytesChart.setData(data);
    }
    const total = Object.values((state && state.totals.uplink_bytes) || {}).reduce((a, b) => a + b, 0);
    $("bytes-caption").textContent = `(accepted updates; ${bytes(total)} in all)`;
  }

  // ---------------------------------------------------------------- panels
  function drawHeader() {
    $("title").textContent = state.title || "fedbit";
    document.title = (state.title || "fedbit") + " - fedbit dashboard";
    const badge = $("state");
    badge.textContent = state.state;
    badge.className = "badge " + state.state;
    const c = state.current || {};
    $("round-label").textContent = c.mode === "buffered" ? `version ${c.version || 0} of ${state.rounds_planned || "?"}`
      : `round ${c.round || 0} of ${state.rounds_planned || "?"}`;
    const alerts = state.alerts || [];
    $("alert").hidden = !alerts.length;
    $("alert").textContent = alerts.length ? `ALERT (round ${alerts[alerts.length - 1].round}): ` +
      alerts[alerts.length - 1].text : "";
  }

  function drawStaleness() {
    const counts = Object.entries(state.staleness || {}).map(([k, v]) => [Number(k), v]).sort((a, b) => a[0] - b[0]);
    $("staleness-panel").hidden = !counts.length && (state.current || {}).mode !== "buffered";
    const body = $("staleness").tBodies[0];
    body.replaceChildren();
    const most = Math.max(1, ...counts.map(([, v]) => v));
    for (const [tau, n] of counts) {
      const tr = el("tr"), bar = el("div", null, "hbar");
      bar.style.width = (100 * n / most).toFixed(1) + "%";
      const td = el("td");
      td.append(bar);
      tr.append(el("td", tau, "num"), el("td", n, "num"), td);
      body.append(tr);
    }
  }

  function drawProgress() {
    const c = state.current || {};
    if (c.mode === "buffered") {  // a buffer filling, not a round
      const refused = ((state.totals || {}).refused || {}).rejected_stale || 0;
      facts($("progress"), [["model version", `${c.version || 0} of ${state.rounds_planned || "?"}`],
                            ["buffer", `${c.fill ?? 0} of ${c.size ?? "?"} updates`],
                            ["devices training", c.in_flight ?? 0], ["refused as stale", refused]]);
      $("progress-bar").style.width = (100 * Math.min(1, (c.fill || 0) / (c.size || 1))).toFixed(1) + "%";
      return;
    }
    const pairs = [["round", `${c.round || 0} of ${state.rounds_planned || "?"}`]];
    if (c.phase === "waiting" && c.need) {
      pairs.push(["phase", `waiting for devices: ${c.present ?? 0} of ${c.need} present`]);
    } else {
      pairs.push(["phase", c.phase || "-"]);
    }
    pairs.push(["selected", c.selected ?? 0], ["received", c.received ?? 0]);
    if (c.phase === "collecting" && c.deadline) {
      pairs.push(["deadline", `in ${Math.max(0, c.deadline - Date.now() / 1000).toFixed(0)} s`]);
    }
    if (c.phase === "collecting" && c.outstanding) {
      const ids = c.outstanding_ids || [];
      const more = c.outstanding > ids.length ? ` and ${c.outstanding - ids.length} more` : "";
      pairs.push(["waiting for", ids.join(", ") + more]);
    }
    const gone = Object.entries(c.gone || {});
    if (gone.length) pairs.push(["gone (stragglers)", gone.map(([d, why]) => `${d} (${why})`).join(", ")]);
    if (c.phase === "closed") pairs.push(["stragglers", c.stragglers ?? 0]);
    if (c.wait_seconds >= 0.1) pairs.push(["waited for devices", secs(c.wait_seconds)]);
    const last = rounds[rounds.length - 1];
    if (last) pairs.push(["last round took", secs(last.round_seconds) + (last.wait_seconds >= 0.1 ?
      ` (+ ${secs(last.wait_seconds)} waiting for devices)` : "")]);
    facts($("progress"), pairs);
    const frac = c.selected ? Math.min(1, (c.received || 0) / c.selected) : 0;
    $("progress-bar").style.width = (100 * frac).toFixed(1) + "%";
  }

  function drawTotals() {
    const t = state.totals || {};
    const pairs = [["rounds completed", t.rounds ?? 0], ["updates accepted", t.accepted ?? 0],
                   ["devices online", `${state.online} of ${state.devices_total} known`]];
    for (const [k, v] of Object.entries(t.refused || {})) pairs.push([k.replace(/_/g, " "), v]);
    for (const [k, v] of Object.entries(t.uplink_bytes || {})) pairs.push([`uplink ${k}`, bytes(v)]);
    if (t.wait_seconds) pairs.push(["waited for devices", secs(t.wait_seconds)]);
    const dp = rounds.filter((r) => r.epsilon != null).pop();
    if (dp) pairs.push(["privacy spent", `ε = ${dp.epsilon.toFixed(3)} at δ = ${dp.delta}`]);
    facts($("totals"), pairs);
  }

  function drawDevices() {
    const body = $("devices").tBodies[0];
    body.replaceChildren();
    for (const d of state.devices) {
      const tr = el("tr", null, d.online ? "online" : d.registered ? "offline" : "stranger");
      tr.dataset.device = d.device_id;
      const notes = Object.entries(d.refusals).map(([k, v]) => `${k} x${v}`)
        .concat(Object.entries(d.notes).map(([k, v]) => `${k.replace(/_/g, " ")} x${v}`));
      const last = d.last_round ? `round ${d.last_round}: ${bytes(d.last_bytes)} ${d.last_codec}` : "-";
      const quarantined = (d.quarantined || []).length > 0;
      const status = (quarantined ? "QUARANTINED, " : "") +
        (d.online ? "online" : d.registered ? "offline" : "refused (no hello accepted)");
      if (quarantined) { tr.classList.add("quarantined"); tr.title = d.quarantined.join("\n"); }
      tr.append(el("td", d.device_id), el("td", status, "status"), el("td", d.profile),
                el("td", d.variant), el("td", d.codec), el("td", ago(d.last_seen), "seen"), el("td", last),
                el("td", d.updates, "num"), el("td", notes.join(", "), "refused"));
      body.append(tr);
    }
    const shown = state.devices.length < state.devices_total ? `; the first ${state.devices.length} by id shown` : "";
    const q = (state.quarantined || []).length ? `; quarantined: ${state.quarantined.join(", ")}` : "";
    $("devices-caption").textContent = `(${state.online} online of ${state.devices_total}${shown}${q})`;
  }

  function drawRefusals() {
    const body = $("refusals").tBodies[0];
    body.replaceChildren();
    if (!state.recent_refusals.length) {
      const tr = el("tr"), td = el("td", "none", "detail");
      td.colSpan = 5;
      tr.append(td);
      body.append(tr);
    }
    for (const r of [...state.recent_refusals].reverse()) {
      const tr = el("tr");
      tr.append(el("td", new Date(r.time * 1000).toLocaleTimeString()), el("td", r.device), el("td", r.kind),
                el("td", (r.dropped ? "dropped: " : "") + r.reason), el("td", r.detail, "detail"));
      body.append(tr);
    }
  }

  function drawConfig() {
    const body = $("config").tBodies[0];
    body.replaceChildren();
    const flat = (obj, prefix) => {
      for (const [k, v] of Object.entries(obj || {})) {
        const key = prefix ? `${prefix}.${k}` : k;
        if (v && typeof v === "object" && !Array.isArray(v)) flat(v, key);
        else { const tr = el("tr"); tr.append(el("td", key), el("td", JSON.stringify(v))); body.append(tr); }
      }
    };
    flat(state.job, "");
  }

  function render(full) {
    drawHeader(); drawProgress(); drawTotals(); drawStaleness(); drawDevices(); drawRefusals();
    if (full) drawConfig();
    drawAccuracy(); drawBytes();
    api.history.push([Date.now(), api.accuracyPoints(), state.online]);
  }

  // ---------------------------------------------------------------- the stream
  function connect() {
    const src = new EventSource("/events");
    src.addEventListener("open", () => { $("link").textContent = "live"; $("link").className = "link on"; });
    src.addEventListener("error", () => {
      if (state && ["done", "stopped", "error"].includes(state.state)) {
        src.close();  // the job ended and its coordinator with it: nothing more will come
        $("link").textContent = "job ended";
      } else {
        $("link").textContent = "reconnecting";
      }
      $("link").className = "link off";
    });
    src.addEventListener("snapshot", (e) => {
      state = JSON.parse(e.data);
      rounds = state.rounds;
      api.updates++;
      render(true);
    });
    src.addEventListener("update", (e) => {
      const msg = JSON.parse(e.data);
      const now = Date.now() / 1000;
      for (const r of msg.rounds) {
        if (r.closed_at) api.latencies.push(now - r.closed_at);
      }
      rounds = rounds.concat(msg.rounds);
      state = msg;
      api.updates++;
      render(false);
    });
  }

  setInterval(() => { if (state) { drawProgress(); drawDevices(); } }, 1000);
  window.addEventListener("resize", () => {
    if (accChart) accChart.setSize({width: width("acc-chart"), height: 260});
    if (bytesChart) bytesChart.setSize({width: width("bytes-chart"), height: 220});
  });
  connect();
})();
