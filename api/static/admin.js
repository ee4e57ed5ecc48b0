// The usage page's charts: one fetch of the JSON route the page names (the same route the
// CSV link and other clients read), drawn as stacked bars, one series per group. The charts
// stay reachable as window.adminCharts so their data can be read back.
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777",
  "#65a30d", "#9ca3af"];

function label(iso, bucket) {
  return bucket === "day" ? iso.slice(0, 10) : iso.slice(0, 13).replace("T", " ") + "h";
}

function stacked(canvas, labels, series, values, scale) {
  return new Chart(canvas, {
    type: "bar",
    data: {
      labels,
      datasets: series.map((s, i) => ({
        label: s.label,
        data: values(s).map((v) => v / scale),
        backgroundColor: PALETTE[i % PALETTE.length],
      })),
    },
    options: {
      animation: false,
      maintainAspectRatio: false,
      scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true } },
    },
  });
}

function fillTopTenants(rows) {
  const body = document.querySelector("#top-tenants tbody");
  body.replaceChildren();
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const [text, numeric] of [[row.name, false], [row.tokens.toLocaleString("en-US"), true],
      [row.cost, true]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (numeric) td.className = "num";
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

async function drawUsage() {
  const holder = document.getElementById("usage");
  const status = document.getElementById("usage-status");
  const response = await fetch(holder.dataset.source, { credentials: "same-origin" });
  const body = await response.json();
  if (!response.ok) {
    status.textContent = `${response.status}: ${body.detail}`;
    status.className = "error";
    return;
  }
  const labels = body.buckets.map((iso) => label(iso, body.bucket));
  window.adminCharts = {
    tokens: stacked(document.getElementById("tokens-chart"), labels, body.series,
      (s) => s.tokens, 1),
    cost: stacked(document.getElementById("cost-chart"), labels, body.series,
      (s) => s.cost_micros, 1e6),
  };
  fillTopTenants(body.top_tenants);
  status.textContent = body.series.length ? "" : "No usage in this range.";
  holder.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", drawUsage);
