// The billing page's charts: GPU-hours and tokens per UTC day, from the page's own data.
(() => {
  const root = document.getElementById("daily-charts");
  const source = document.getElementById("daily-usage");
  if (!root || !source) return;
  const daily = JSON.parse(source.textContent);
  const days = daily.days.map((day) => Date.parse(`${day}T00:00:00Z`) / 1000);
  const colours = ["#2f54eb", "#e8590c"];
  const charts = [];

  function size(el) {
    return { width: Math.max(240, el.clientWidth), height: 180 };
  }

  root.querySelectorAll("[data-series]").forEach((el) => {
    const names = el.dataset.series.split(",");
    charts.push(new uPlot({
      ...size(el),
      scales: { x: { time: true } },
      series: [{}, ...names.map((name, i) => ({
        label: name.replaceAll("_", " "), stroke: colours[i], width: 2,
        points: { show: true, size: 5 },
      }))],
    }, [days, ...names.map((name) => daily[name])], el));
  });
  window.addEventListener("resize", () => {
    root.querySelectorAll("[data-series]").forEach((el, index) => charts[index].setSize(size(el)));
  });
})();
