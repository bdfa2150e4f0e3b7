// The endpoint page's charts: each group ([data-charts]) redrawn every 10 s from its URL.
// The usage group: the last hour of usage records, a point per minute; the KV group: the
// engines' metrics as the node agent read them, a point per minute with samples; the replica
// timeline: replicas per phase over 6 hours, a point per change, drawn stepped
// (data-stepped: each count holds until the next point).
(() => {
  const count = new Intl.NumberFormat();
  const COLOURS = ["#2f54eb", "#e8590c", "#868e96", "#7a5af8", "#12b76a", "#c11574",
                   "#0e9384", "#b54708"];

  function size(el) {
    return { width: Math.max(240, el.clientWidth), height: 160 };
  }

  function usageTotals(usage) {
    return `${count.format(usage.requests)} ${usage.requests === 1 ? "request" : "requests"}, ` +
      `${count.format(usage.prompt_tokens)} prompt and ${count.format(usage.completion_tokens)} ` +
      "generated tokens in the last hour.";
  }

  function group(root) {
    const charts = [];
    const x = root.dataset.x || "minutes";
    let latest = null;

    async function refresh() {
      const response = await fetch(root.dataset.url, { headers: { Accept: "application/json" } });
      if (!response.ok) return;
      const data = await response.json();
      latest = data;
      if (root.dataset.totals) {
        document.querySelector(root.dataset.totals).textContent = usageTotals(data);
      }
      if (root.dataset.empty) {
        document.querySelector(root.dataset.empty).hidden = data[x].length > 0;
      }
      root.querySelectorAll("[data-series]").forEach((el, index) => {
        const names = el.dataset.series.split(",");
        const series = [data[x], ...names.map((name) => data[name])];
        if (!charts[index]) {
          const options = {
            ...size(el),
            // The window the group says it covers (data.since/until), or its points'.
            scales: { x: { time: true, range: (u, min, max) => {
              if (latest.since !== undefined) return [latest.since, latest.until];
              return latest[x].length ? [latest[x][0], latest[x][latest[x].length - 1]] : [min, max];
            } } },
            // Counts of replicas: whole numbers on the axis.
            ...("stepped" in el.dataset ? { axes: [{}, { incrs: [1, 2, 5, 10, 20, 50] }] } : {}),
            // A series keyed "model:<name>" is labelled by the model's name.
            series: [{}, ...names.map((name, i) => ({
              label: name.startsWith("model:") ? name.slice(6) : name.replaceAll("_", " "),
              stroke: COLOURS[i % COLOURS.length], width: 2,
              ...("stepped" in el.dataset
                ? { paths: uPlot.paths.stepped({ align: 1 }), points: { show: false } }
                : { points: { show: true, size: 5 } }),
            }))],
          };
          charts[index] = new uPlot(options, series, el);
        } else {
          charts[index].setData(series);
        }
      });
    }

    refresh();
    setInterval(refresh, 10000);
    window.addEventListener("resize", () => {
      root.querySelectorAll("[data-series]").forEach((el, index) => charts[index]?.setSize(size(el)));
    });
  }

  document.querySelectorAll("[data-charts]").forEach(group);
})();
