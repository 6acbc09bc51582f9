// CircuitKit report: the charts of report.html, drawn by plotly.js (inlined, gzip + base64, in
// #plotly-gz). The data is the JSON in #report-data (circuitkit_app/report/collect.py). Tests
// read window.circuitReport: {ready, readyMs, error, drawnEdges, drawnNodes, setEdges(n)}.
"use strict";

(function () {
  const state = { ready: false, error: null, drawnEdges: 0, drawnNodes: 0 };
  window.circuitReport = state;

  async function loadPlotly() {
    const b64 = document.getElementById("plotly-gz").textContent.trim();
    const binary = atob(b64);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    state.timings.decoded = Math.round(performance.now());
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    const code = await new Response(stream).text();
    state.timings.unzipped = Math.round(performance.now());
    const script = document.createElement("script");
    script.textContent = code;
    document.head.appendChild(script);
  }

  const BLUE = "#2166ac", RED = "#b2182b";
  const DASH = { q: "solid", k: "dash", v: "dot", "": "solid" };
  const BEND = { q: 1, k: 2, v: -1.2, "": 0.6 };
  const LETTER = { q: "query", k: "key", v: "value", "": "input" };
  const fmt = (x) => (x === null || x === undefined ? "n/a" : Number(x).toPrecision(4));
  // plotly reads its text as a small HTML subset (<br>, <b>, <a href>...): text from the run (override
  // values, keys, names) goes in with & < > as entities, so it is shown as written, never as markup.
  const ENTITY = { "&": "&amp;", "<": "&lt;", ">": "&gt;" };
  const plain = (s) => String(s).replace(/[&<>]/g, (c) => ENTITY[c]);
  const config = { displaylogo: false, responsive: true };

  function headName(layer, head) { return "a" + layer + ".h" + head; }
  function layerOf(name) { const m = /^[am](\d+)/.exec(name); return m ? Number(m[1]) : null; }

  function drawHeadMap(data) {
    const a = data.attribution;
    const el = document.getElementById("head-map");
    if (!a || !el) return;
    const kept = new Set((data.circuit && data.circuit.kept_heads) || []);
    const kx = [], ky = [];
    for (let l = 0; l < a.n_layers; l++) for (let h = 0; h < a.n_heads; h++) {
      if (kept.has(headName(l, h))) { kx.push(h); ky.push(l); }
    }
    const flat = a.head_scores.flat().map((v) => Math.abs(v || 0));
    const lim = Math.max(...flat, 1e-12);
    const traces = [{
      type: "heatmap", z: a.head_scores, colorscale: "RdBu", reversescale: true, zmin: -lim, zmax: lim,
      hovertemplate: "L%{y} H%{x}: %{z:.4g}<extra></extra>", colorbar: { title: { text: "score" } },
    }];
    if (kx.length) traces.push({
      type: "scatter", mode: "markers", x: kx, y: ky, name: "kept in the circuit", hoverinfo: "skip",
      marker: { symbol: "square-open", size: 14, color: "#111", line: { width: 2 } },
    });
    Plotly.newPlot(el, traces, {
      title: { text: "head scores (layers x heads); open squares: kept" }, height: Math.max(320, 18 * a.n_layers + 140),
      xaxis: { title: { text: "head" }, dtick: 1 }, yaxis: { title: { text: "layer" }, autorange: "reversed", dtick: 1 },
      showlegend: false, margin: { t: 50 },
    }, config);
    el.on("plotly_click", (ev) => { const p = ev.points[0]; showHead(data, headName(p.y, p.x)); });
  }

  function showHead(data, name) {
    const el = document.getElementById("head-detail");
    if (!el) return;
    const a = data.attribution, c = data.circuit;
    const m = /^a(\d+)\.h(\d+)$/.exec(name);
    if (!m || !a || !a.per_example_head) {
      el.textContent = name + ": no per-example scores in this run (discovery.per_example=true keeps them).";
      return;
    }
    const l = Number(m[1]), h = Number(m[2]);
    const ys = a.per_example_head.map((ex) => ex[l][h]);
    let title = name + ": score per example (" + ys.length + " of " + a.per_example_total + "), mean " +
      fmt(a.head_scores[l][h]);
    if (c && c.kept_frequency) title += "; kept in " + Math.round(100 * c.kept_frequency[l][h]) + "% of resamples";
    el.textContent = "";
    Plotly.newPlot(el, [{ type: "bar", x: ys.map((_, i) => i), y: ys, marker: { color: ys.map((v) => (v >= 0 ? BLUE : RED)) },
      hovertemplate: "example %{x}: %{y:.4g}<extra></extra>" }], {
      title: { text: title, font: { size: 13 } }, height: 260, margin: { t: 40, b: 40 },
      xaxis: { title: { text: "example" } }, yaxis: { title: { text: "score" } },
    }, config);
    state.detail = name;
  }

  // ---------------------------------------------------------------- the circuit graph
  function layout(g, n) {
    const edges = g.edges.filter((e) => e[4] < n);
    const kept = new Set(g.kept);
    const shown = new Set(["input", "logits"]);
    for (const k of kept) if (k.startsWith("a")) shown.add(k);
    for (const e of edges) { shown.add(e[0]); shown.add(e[1]); }
    const layers = [...new Set([...shown].map(layerOf).filter((x) => x !== null))].sort((x, y) => x - y);
    const row = new Map(layers.map((l, i) => [l, i + 1]));
    const pos = new Map();
    const mid = (g.n_heads - 1) / 2;
    for (const name of shown) {
      if (name === "input") pos.set(name, [mid, 0]);
      else if (name === "logits") pos.set(name, [mid, layers.length + 1]);
      else if (name.startsWith("m")) pos.set(name, [g.n_heads, row.get(layerOf(name)) + 0.45]);
      else { const h = Number(name.split(".h")[1]); pos.set(name, [h, row.get(layerOf(name))]); }
    }
    return { edges, shown, layers, pos, kept };
  }

  function curve(p, q, bend) {
    // a quadratic Bezier from p to q, bent sideways so that edges along one column stay apart
    const mx = (p[0] + q[0]) / 2, my = (p[1] + q[1]) / 2;
    const dx = q[0] - p[0], dy = q[1] - p[1], len = Math.hypot(dx, dy) || 1;
    const cx = mx - (dy / len) * bend, cy = my + (dx / len) * bend;
    const xs = [], ys = [];
    for (let i = 0; i <= 10; i++) {
      const t = i / 10, u = 1 - t;
      xs.push(u * u * p[0] + 2 * u * t * cx + t * t * q[0]);
      ys.push(u * u * p[1] + 2 * u * t * cy + t * t * q[1]);
    }
    return [xs, ys];
  }

  function spreadText(s) {
    return s ? "<br>over examples: mean " + fmt(s[0]) + ", sd " + fmt(s[1]) + ", 5-95% " + fmt(s[2]) + " .. " + fmt(s[3]) : "";
  }

  function drawCircuit(data, n) {
    const c = data.circuit, el = document.getElementById("circuit-graph");
    if (!c || !el) return;
    const g = c.graph;
    const L = layout(g, n);
    const maxAbs = Math.max(1e-12, ...g.edges.map((e) => Math.abs(e[3] || 0)));
    const groups = new Map();
    const mids = { x: [], y: [], text: [] };
    for (const e of L.edges) {
      const [from, to, letter, score, rank] = e;
      const p = L.pos.get(from), q = L.pos.get(to);
      const bucket = Math.min(3, Math.floor(4 * Math.abs(score || 0) / maxAbs));
      const key = (score >= 0 ? "+" : "-") + letter + bucket;
      if (!groups.has(key)) groups.set(key, { x: [], y: [], sign: score >= 0, letter, bucket });
      const bend = (p[0] === q[0] ? 0.3 : 0.1) * BEND[letter];  // q, k, v apart between the same two nodes
      const [xs, ys] = curve(p, q, bend);
      const grp = groups.get(key);
      grp.x.push(...xs, null); grp.y.push(...ys, null);
      mids.x.push(xs[5]); mids.y.push(ys[5]);
      const spread = g.edge_spread ? [g.edge_spread[0][rank], g.edge_spread[1][rank], g.edge_spread[2][rank],
        g.edge_spread[3][rank]] : null;
      mids.text.push(from + " → " + to + (letter ? " (" + LETTER[letter] + ")" : "") + "<br>score " + fmt(score) +
        " (rank " + (rank + 1) + " of " + g.n_candidates + ")" + spreadText(spread) +
        (g.edge_kept_frequency ? "<br>kept in " + Math.round(100 * g.edge_kept_frequency[rank]) + "% of resamples" : ""));
    }
    const traces = [];
    for (const grp of groups.values()) traces.push({
      type: "scatter", mode: "lines", x: grp.x, y: grp.y, hoverinfo: "skip", showlegend: false,
      line: { color: grp.sign ? BLUE : RED, width: 1 + 1.6 * grp.bucket, dash: DASH[grp.letter] },
      opacity: 0.75,
    });
    traces.push({ type: "scatter", mode: "markers", x: mids.x, y: mids.y, text: mids.text, name: "edges",
      hovertemplate: "%{text}<extra></extra>", marker: { size: 9, color: "rgba(0,0,0,0)" }, showlegend: false });
    const nodes = [...L.shown];
    const scores = nodes.map((k) => g.node_scores[k]);
    const lim = Math.max(1e-12, ...scores.map((v) => Math.abs(v || 0)));
    traces.push({
      type: "scatter", mode: "markers+text", x: nodes.map((k) => L.pos.get(k)[0]), y: nodes.map((k) => L.pos.get(k)[1]),
      text: nodes, textposition: "middle center", customdata: nodes, name: "nodes", showlegend: false,
      textfont: { size: 9, color: scores.map((v) => (Math.abs(v || 0) > 0.45 * lim ? "#fff" : "#111")) },
      hovertext: nodes.map((k) => k + (L.kept.has(k) ? " (kept)" : "") + "<br>score " + fmt(g.node_scores[k]) +
        spreadText(g.node_spread[k])),
      hovertemplate: "%{hovertext}<extra></extra>",
      marker: { size: 36, symbol: nodes.map((k) => (k.startsWith("m") ? "square" : "circle")),
        color: scores.map((v) => (v === null || v === undefined ? 0 : v)), colorscale: "RdBu", reversescale: true,
        cmin: -lim, cmax: lim, line: { width: 1, color: "#333" } },
    });
    const ticks = [0, ...L.layers.map((_, i) => i + 1), L.layers.length + 1];
    const labels = ["input", ...L.layers.map((l) => "L" + l), "logits"];
    const annotations = [];
    for (let i = 0; i + 1 < L.layers.length; i++) {
      const gap = L.layers[i + 1] - L.layers[i] - 1;
      if (gap > 0) annotations.push({ x: g.n_heads + 0.9, y: i + 1.7, text: gap + " layer" + (gap > 1 ? "s" : "") +
        " folded", showarrow: false, font: { size: 10, color: "#777" }, xanchor: "left" });
    }
    if (L.layers.length && L.layers[0] > 0) annotations.push({ x: g.n_heads + 0.9, y: 0.6, text: L.layers[0] +
      " layers folded", showarrow: false, font: { size: 10, color: "#777" }, xanchor: "left" });
    const layoutSpec = {
      height: Math.max(420, 70 * (L.layers.length + 2)), margin: { t: 30, l: 60, r: 110 }, hovermode: "closest",
      dragmode: "pan", annotations,
      xaxis: { showgrid: false, zeroline: false, tickvals: [...Array(g.n_heads).keys(), g.n_heads],
        ticktext: [...Array(g.n_heads).keys()].map((h) => "h" + h).concat(["MLP"]), range: [-0.8, g.n_heads + 2] },
      yaxis: { autorange: "reversed", tickvals: ticks, ticktext: labels, zeroline: false, showgrid: true },
    };
    Plotly.react(el, traces, layoutSpec, Object.assign({ scrollZoom: true }, config));
    state.drawnEdges = L.edges.length;
    state.drawnNodes = nodes.length;
    el.dataset.drawnEdges = String(L.edges.length);
    el.dataset.drawnNodes = String(nodes.length);
    const shownHeads = nodes.filter((k) => k.startsWith("a")).length;
    document.getElementById("circuit-count").textContent = L.edges.length + " edges drawn (" + n + " strongest of " +
      g.n_candidates + " candidates; " + g.n_edges_total + " edges in the graph), " + shownHeads + " heads, " +
      nodes.filter((k) => k.startsWith("m")).length + " MLPs";
  }

  function setupCircuit(data) {
    const c = data.circuit;
    if (!c) return;
    const g = c.graph;
    const slider = document.getElementById("edge-slider"), box = document.getElementById("edge-box");
    const start = Math.max(g.default_edges, Math.min(1, g.n_ranked));
    if (slider) {
      slider.max = String(Math.max(1, g.n_ranked)); slider.value = String(start);
      box.max = slider.max; box.value = slider.value;
      slider.disabled = box.disabled = g.n_ranked === 0;
      slider.addEventListener("input", () => { box.value = slider.value; drawCircuit(data, Number(slider.value)); });
      box.addEventListener("change", () => {
        const v = Math.max(1, Math.min(g.n_ranked, Number(box.value) || 1));
        box.value = slider.value = String(v); drawCircuit(data, v);
      });
    }
    state.setEdges = (n) => { if (slider) { slider.value = box.value = String(n); } drawCircuit(data, n); };
    drawCircuit(data, start);
    const el = document.getElementById("circuit-graph");
    el.on("plotly_click", (ev) => { const p = ev.points.find((q) => q.customdata); if (p) showHead(data, p.customdata); });
    if (g.layer_totals) {
      const t = g.layer_totals;
      Plotly.newPlot(document.getElementById("layer-map"), [{ type: "heatmap", z: t.z, x: t.cols, y: t.rows,
        colorscale: "Viridis", hovertemplate: "%{y} → %{x}: Σ|score| %{z:.4g}<extra></extra>" }], {
        title: { text: "all " + g.n_edges_total + " edges: Σ|score| from layer (rows) to layer (columns)" },
        height: Math.max(320, 16 * t.rows.length + 140), yaxis: { autorange: "reversed" }, margin: { t: 50 },
      }, config);
    }
  }

  function drawCurve(data) {
    const c = data.circuit, el = document.getElementById("curve");
    if (!c || !el || !c.curve.length) return;
    const xs = c.curve.map((r) => r.percent_kept), ys = c.curve.map((r) => r.faithfulness);
    const traces = [{ type: "scatter", mode: "lines+markers", x: xs, y: ys, name: "faithfulness",
      text: c.curve.map((r) => r.n_kept), hovertemplate: "%{x}% kept (%{text}): %{y:.4f}<extra></extra>" }];
    if (c.metrics && c.metrics.faithfulness !== null && c.achieved_sparsity !== null) {
      traces.push({ type: "scatter", mode: "markers", x: [100 * (1 - c.achieved_sparsity)], y: [c.metrics.faithfulness],
        name: "the circuit", marker: { size: 14, symbol: "star", color: "#e08214" },
        hovertemplate: "the circuit: %{y:.4f}<extra></extra>" });
    }
    Plotly.newPlot(el, traces, {
      title: { text: "faithfulness against share kept; CPR " + fmt(c.cpr) + ", CMD " + fmt(c.cmd) },
      xaxis: { type: "log", title: { text: "% kept" } }, yaxis: { title: { text: "faithfulness" } }, height: 360,
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { dash: "dot", color: "#999" } }],
    }, config);
    if (c.kept_frequency) {
      Plotly.newPlot(document.getElementById("stability-map"), [{ type: "heatmap", z: c.kept_frequency,
        colorscale: "Greens", reversescale: true, zmin: 0, zmax: 1, hovertemplate: "L%{y} H%{x}: kept in %{z:.0%} of resamples<extra></extra>" }],
      { title: { text: "how often each head is kept over the bootstrap resamples" }, height: Math.max(300, 16 * c.kept_frequency.length + 140),
        yaxis: { autorange: "reversed", title: { text: "layer" }, dtick: 1 }, xaxis: { title: { text: "head" }, dtick: 1 },
        margin: { t: 50 } }, config);
    }
  }

  function drawMemory(data) {
    const m = data.memory, el = document.getElementById("memory-terms");
    if (!m || !el || !m.memory_terms) return;
    const stages = Object.keys(m.memory_terms);
    if (!stages.length) return;
    const names = [...new Set(stages.flatMap((s) => Object.keys(m.memory_terms[s])))];
    const traces = names.map((name) => ({
      type: "bar", orientation: "h", name: plain(name), y: stages.map(plain),
      x: stages.map((s) => (m.memory_terms[s][name] || 0) / 2 ** 20),
      hovertemplate: "%{y}: " + plain(name) + " %{x:.1f} MiB<extra></extra>",
    }));
    Plotly.newPlot(el, traces, {
      barmode: "stack", title: { text: "the preflight's peak estimate by term, MiB (made before the data exists, at the configured lengths)" +
        (m.free_bytes ? "; free device memory " + (m.free_bytes / 2 ** 30).toFixed(1) + " GiB" : "") },
      height: 120 + 40 * stages.length, margin: { t: 40, l: 90 }, xaxis: { title: { text: "MiB" } },
      legend: { orientation: "h", y: -0.4 },
    }, config);
  }

  function drawSweep(data) {
    const s = data.sweep;
    if (!s) return;
    const metrics = [["wall_s", "wall time (s)"], ["peak_mib", "peak memory (MiB)"], ["result", s.result_label]];
    s.swept.forEach((key, i) => {
      metrics.forEach(([field, label], j) => {
        const el = document.getElementById("sweep-" + i + "-" + j);
        const ok = s.jobs.filter((r) => r[field] !== null && r[field] !== undefined);
        Plotly.newPlot(el, [{ type: "scatter", mode: "markers+lines", x: ok.map((r) => plain(r.values[key])),
          y: ok.map((r) => r[field]), text: ok.map((r) => plain("job " + r.job + ": " + r.overrides)),
          marker: { size: 10, color: ok.map((r) => (r.status === "ok" ? BLUE : RED)) },
          hovertemplate: "%{text}<br>%{y}<extra></extra>" }], {
          title: { text: plain(label + " against " + key), font: { size: 13 } }, height: 300, margin: { t: 40 },
          xaxis: { type: "category", title: { text: plain(key) } },
        }, config);
      });
    });
  }

  async function main() {
    try {
      const t = (label) => { state.timings[label] = Math.round(performance.now()); };
      state.timings = {};
      t("start");
      await loadPlotly();
      t("plotly");
      const data = JSON.parse(document.getElementById("report-data").textContent);
      drawHeadMap(data);
      t("heads");
      setupCircuit(data);
      t("circuit");
      drawCurve(data);
      drawMemory(data);
      drawSweep(data);
      t("curves");
      state.readyMs = performance.now();  // since navigation start
      state.ready = true;
    } catch (err) {
      state.error = String(err);
      const box = document.getElementById("load-error");
      if (box) { box.hidden = false; box.textContent = "The charts could not be drawn: " + err; }
      console.error(err);
    }
  }
  main();
})();
