// The Reports page's chart: USD per month, stacked by team, with the idle cost on
// top. The figures come from the page itself (json_script), never from HTML.
(function () {
  "use strict";

  var canvas = document.getElementById("report-chart");
  var source = document.getElementById("report-chart-data");
  if (!canvas || !source || !window.Chart) {
    return;
  }
  var chart = JSON.parse(source.textContent);
  new window.Chart(canvas, {
    type: "bar",
    data: chart,
    options: {
      animation: false,
      responsive: true,
      scales: {
        x: { stacked: true },
        y: { stacked: true, title: { display: true, text: "USD" } },
      },
    },
  });
  canvas.setAttribute("data-drawn", "1");
})();
