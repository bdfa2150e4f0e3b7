// The endpoint page's charts: the last hour of usage records, a point per minute, redrawn
// every 10 s from the page's usage URL.
(() => {
  const root = document.getElementById("charts");
  if (!root) return;
  const charts = [];
  let latest = null;
  const totals = document.getElementById("usage-totals");

  function size(el) {
    return { width: Math.max(240, el.clientWidth), height: 160 };
  }

  async function refresh() {
    const response = await fetch(root.dataset.url, { headers: { Accept: "application/json" } });
    if (!response.ok) return;
    const usage = await response.json();
    latest = usage;
    const count = new Intl.NumberFormat();
    totals.textContent = `${count.format(usage.requests)} ` +
      `${usage.requests === 1 ? "request" : "requests"}, ` +
      `${count.format(usage.prompt_tokens)} prompt and ${count.format(usage.completion_tokens)} ` +
      "generated tokens in the last hour.";
    root.querySelectorAll("[data-series]").forEach((el, index) => {
      const names = el.dataset.series.split(",");
      const data = [usage.minutes, ...names.map((name) => usage[name])];
      if (!charts[index]) {
        const options = {
          ...size(el),
          scales: { x: { time: true, range: () => [latest.minutes[0], latest.minutes[latest.minutes.length - 1]] } },
          series: [{}, ...names.map((name, i) => ({
            label: name.replaceAll("_", " "), stroke: i ? "#e8590c" : "#2f54eb", width: 2,
            points: { show: true, size: 5 },
          }))],
        };
        charts[index] = new uPlot(options, data, el);
      } else {
        charts[index].setData(data);
      }
    });
  }
  refresh();
  setInterval(refresh, 10000);
  window.addEventListener("resize", () => {
    root.querySelectorAll("[data-series]").forEach((el, index) => charts[index]?.setSize(size(el)));
  });
})();
