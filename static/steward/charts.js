// Draws every <canvas data-chart="ID"> from the JSON in <script type="application/json" id="ID">
// (Django's json_script). Runs on page load and again on every htmx swap, so live-refreshed
// fragments redraw their charts. Data shape:
//   {"type": "line"|"bar", "labels": [...], "datasets": [{"label": "...", "data": [...]}],
//    "y_label": "...", "x_label": "...", "stacked": false}
(function () {
  "use strict";
  const palette = ["#1f5fbf", "#b3261e", "#2e7d32", "#a86400", "#6a1b9a", "#00838f", "#5b6575"];

  function draw(canvas) {
    const source = document.getElementById(canvas.dataset.chart);
    if (!source || typeof Chart === "undefined") return;
    const spec = JSON.parse(source.textContent);
    const existing = Chart.getChart(canvas);
    if (existing) existing.destroy();
    const datasets = (spec.datasets || []).map(function (d, i) {
      const colour = d.color || palette[i % palette.length];
      return Object.assign({
        borderColor: colour,
        backgroundColor: spec.type === "bar" ? colour : colour + "33",
        pointRadius: (d.data || []).length > 60 ? 0 : 2,
        borderWidth: 2,
        tension: 0.15,
      }, d);
    });
    new Chart(canvas, {
      type: spec.type || "line",
      data: { labels: spec.labels || [], datasets: datasets },
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { display: datasets.length > 1 } },
        scales: {
          x: { stacked: !!spec.stacked, title: { display: !!spec.x_label, text: spec.x_label },
               ticks: { maxTicksLimit: 12, autoSkip: true } },
          y: { stacked: !!spec.stacked, beginAtZero: spec.begin_at_zero !== false,
               title: { display: !!spec.y_label, text: spec.y_label } },
        },
      },
    });
  }

  function drawAll(root) {
    (root || document).querySelectorAll("canvas[data-chart]").forEach(draw);
  }

  document.addEventListener("DOMContentLoaded", function () { drawAll(document); });
  // After a swap: every canvas that has no chart yet (new content — with an outerHTML swap the
  // event's target is the element that was replaced, no longer in the page), and those inside
  // a target that is still in the page (innerHTML swaps keep the canvas element).
  document.addEventListener("htmx:afterSettle", function (e) {
    if (typeof Chart === "undefined") return;
    document.querySelectorAll("canvas[data-chart]").forEach(function (canvas) {
      if (!Chart.getChart(canvas) || (e.target.isConnected && e.target.contains(canvas))) {
        draw(canvas);
      }
    });
  });
})();
