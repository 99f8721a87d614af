/* Tollgate admin charts: draws the JSON blocks the server embeds with the vendored Chart.js and polls
   the replica registry on the engines page. No inline script (the pages' CSP forbids it). */
"use strict";

(function () {
  const COLORS = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#c62828", "#00838f", "#5d4037", "#9e9d24"];
  const REASON_LABELS = {
    rpm: "rejected: requests/min", tpm: "rejected: tokens/min", concurrency: "rejected: concurrency",
    budget: "rejected: budget", suspended: "rejected: suspended", overloaded: "rejected: SLO shedding",
    unavailable: "rejected: unavailable",
  };

  function readJson(id) {
    const node = document.getElementById(id);
    return node ? JSON.parse(node.textContent) : null;
  }

  function chart(id, config) {
    const canvas = document.getElementById(id);
    if (!canvas) return null;
    config.options = Object.assign({ animation: false, responsive: true, maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false } }, config.options || {});
    return new Chart(canvas, config);
  }

  function stacked(extra) {
    return Object.assign({ scales: { x: { stacked: true },
      y: { stacked: true, beginAtZero: true, ticks: { precision: 0 } } } }, extra);
  }

  function usageCharts(data) {
    const labels = data.labels;
    chart("chart-tokens", { type: "bar", data: { labels, datasets: [
      { label: "input (uncached)", data: data.input_tokens, backgroundColor: COLORS[0] },
      { label: "cached input", data: data.cached_tokens, backgroundColor: COLORS[1] },
      { label: "output", data: data.output_tokens, backgroundColor: COLORS[2] },
    ] }, options: stacked() });
    chart("chart-cost", { type: "bar", data: { labels, datasets: [
      { label: "cost (USD)", data: data.cost_usd, backgroundColor: COLORS[3] },
    ] }, options: { scales: { y: { beginAtZero: true } } } });
    chart("chart-cache", { type: "line", data: { labels, datasets: [
      { label: "cache hit rate (%)", data: data.cache_hit_rate.map((v) => (v === null ? null : 100 * v)),
        borderColor: COLORS[1], spanGaps: true },
    ] }, options: { scales: { y: { min: 0, max: 100 } } } });
    // Cache products are prompt tokens the input bars count too: side by side, not stacked.
    chart("chart-cache-products", { type: "bar", data: { labels, datasets: [
      { label: "cache writes", data: data.cache_write_tokens, backgroundColor: COLORS[5] },
      { label: "pinned (ttl)", data: data.cache_pinned_tokens, backgroundColor: COLORS[6] },
      { label: "retained (24h)", data: data.cache_retained_tokens, backgroundColor: COLORS[7] },
      { label: "cost (USD)", data: data.cache_cost_usd, type: "line", yAxisID: "usd", borderColor: COLORS[3] },
    ] }, options: { scales: { y: { beginAtZero: true, ticks: { precision: 0 } },
      usd: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false } } } } });
    // Prediction tokens are output tokens the output bars count too: side by side, not stacked.
    chart("chart-predictions", { type: "bar", data: { labels, datasets: [
      { label: "accepted prediction", data: data.accepted_prediction_tokens, backgroundColor: COLORS[1] },
      { label: "rejected prediction", data: data.rejected_prediction_tokens, backgroundColor: COLORS[4] },
    ] }, options: { scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } } });
    const datasets = [{ label: "requests", data: data.requests, backgroundColor: COLORS[0] }];
    Object.keys(data.rejections).forEach((reason, i) => {
      datasets.push({ label: REASON_LABELS[reason] || reason, data: data.rejections[reason],
        backgroundColor: COLORS[(i + 4) % COLORS.length] });
    });
    chart("chart-requests", { type: "bar", data: { labels, datasets }, options: stacked() });
  }

  function sloCharts(tiers) {
    const labels = tiers.map((t) => t.tier);
    for (const [id, metric, unit] of [["chart-ttft", "ttft", "TTFT"], ["chart-tpot", "tpot", "TPOT"]]) {
      chart(id, { type: "bar", data: { labels, datasets: [
        { label: unit + " p50 (ms)", data: tiers.map((t) => t[metric + "_p50"]), backgroundColor: COLORS[0] },
        { label: unit + " p95 (ms)", data: tiers.map((t) => t[metric + "_p95"]), backgroundColor: COLORS[2] },
        { label: unit + " SLO (ms)", data: tiers.map((t) => t[metric + "_slo_ms"]), type: "line",
          borderColor: COLORS[4], pointStyle: "line", showLine: false, pointRadius: 18, borderWidth: 3 },
      ] }, options: { scales: { y: { type: "logarithmic", title: { display: true, text: "ms (log scale)" } } } } });
    }
  }

  function cell(text, numeric) {
    const td = document.createElement("td");
    td.textContent = text;
    if (numeric) td.className = "num";
    return td;
  }

  const pct = (v) => (v === null || v === undefined ? "—" : (100 * v).toFixed(1) + "%");
  const num = (v, digits) => (v === null || v === undefined ? "—" : Number(v).toFixed(digits || 0));

  function liveReplicas(node) {
    const body = document.querySelector("#replicas tbody");
    const status = document.getElementById("live-status");
    const history = { labels: [], kv: {}, queue: {} };
    const kvChart = chart("chart-kv", { type: "line", data: { labels: [], datasets: [] },
      options: { scales: { y: { min: 0, max: 100, title: { display: true, text: "KV cache used (%)" } } } } });
    const queueChart = chart("chart-queue", { type: "line", data: { labels: [], datasets: [] },
      options: { scales: { y: { beginAtZero: true, title: { display: true, text: "waiting requests" } } } } });
    const POINTS = 60;

    function update(snapshot) {
      body.replaceChildren();
      for (const r of snapshot.replicas) {
        const tr = document.createElement("tr");
        tr.dataset.url = r.url;
        tr.append(cell(r.url), cell(r.model), cell(r.pool),
          cell(r.healthy ? "healthy" : "down" + (r.last_error ? ": " + r.last_error : "")),
          cell(num(r.waiting), true), cell(num(r.running), true), cell(pct(r.kv_usage), true),
          cell(pct(r.prefix_hit_rate), true), cell(num(r.tokens_per_s, 1), true), cell(r.inflight === null ? "—" : num(r.inflight), true),
          cell(r.kv_index ? [r.kv_index.device, r.kv_index.host, r.kv_index.disk].map((n) => num(n)).join(" / ") : "—", true),
          cell(r.role || "—"), cell(num(r.adapters), true));
        tr.children[3].className = r.healthy ? "" : "bad";
        body.append(tr);
      }
      history.labels.push(new Date().toISOString().slice(11, 19));
      if (history.labels.length > POINTS) history.labels.shift();
      for (const r of snapshot.replicas) {
        for (const [key, value] of [["kv", r.kv_usage === null ? null : 100 * r.kv_usage], ["queue", r.waiting]]) {
          const series = (history[key][r.url] = history[key][r.url] || []);
          series.push(value);
          while (series.length > history.labels.length) series.shift();
        }
      }
      for (const [c, key] of [[kvChart, "kv"], [queueChart, "queue"]]) {
        if (!c) continue;
        c.data.labels = history.labels.slice();
        c.data.datasets = Object.keys(history[key]).map((url, i) => ({ label: url, data: history[key][url].slice(),
          borderColor: COLORS[i % COLORS.length], spanGaps: true }));
        c.update();
      }
    }

    update(JSON.parse(node.textContent));
    const refresh = Number(node.dataset.refreshMs) || 2000;
    async function poll() {
      try {
        const response = await fetch(node.dataset.url, { credentials: "same-origin", cache: "no-store" });
        if (response.redirected || !response.ok) throw new Error("HTTP " + response.status);
        update(await response.json());
        status.textContent = "live, updated " + new Date().toISOString().slice(11, 19) + " UTC";
      } catch (err) {
        status.textContent = "not updating (" + err.message + "); reload the page";
      }
      setTimeout(poll, refresh);
    }
    setTimeout(poll, refresh);
  }

  const usage = readJson("usage-data");
  if (usage) usageCharts(usage);
  const tiers = readJson("slo-data");
  if (tiers) sloCharts(tiers);
  const live = document.getElementById("live-data");
  if (live) liveReplicas(live);
})();
