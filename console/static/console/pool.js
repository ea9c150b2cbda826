// The pool page's refresh: every data-refresh-ms it reads the page's JSON feed
// (the same URL with ?format=json, through feed.js), writes the figures into the
// page and adds a point to the chart of tokens in flight against capacity. Without
// Chart.js (window.Chart missing) only the tables refresh.
(function () {
  "use strict";

  var root = document.getElementById("pool");
  if (!root) {
    return;
  }
  var feedUrl = root.getAttribute("data-feed-url");
  var refreshMs = parseInt(root.getAttribute("data-refresh-ms"), 10) || 2000;
  // About ten minutes of points at the default interval.
  var maxPoints = 300;
  var F = window.ConsoleFeed;
  var pct = F.pct;
  var ms = F.ms;
  var perSecond = F.perSecond;
  var plain = F.plain;

  var FORMATS = {
    utilisation: pct,
    autoscaler_utilisation: pct,
    router_utilisation: pct,
    prefix_hit_rate: pct,
    kv_cache_usage_perc: pct,
    ttft_p95_ms: ms,
    ttft_p99_ms: ms,
    tpot_p50_ms: ms,
    capacity_tokens_per_s: perSecond,
    admitted_tokens_per_s: perSecond,
  };

  function writeSummary(feed) {
    var cells = document.querySelectorAll("#pool-summary [data-field]");
    cells.forEach(function (cell) {
      var name = cell.getAttribute("data-field");
      var format = FORMATS[name] || plain;
      cell.textContent = format(feed[name]);
    });
  }

  function cell(row, name, text) {
    var td = document.createElement("td");
    td.setAttribute("data-field", name);
    td.textContent = text;
    row.appendChild(td);
  }

  function writeList(items) {
    var list = document.getElementById("warnings");
    list.replaceChildren();
    items.forEach(function (text) {
      var li = document.createElement("li");
      li.textContent = text;
      list.appendChild(li);
    });
  }

  function writeReplicas(replicas) {
    var body = document.querySelector("#replicas tbody");
    var rows = replicas.map(function (r) {
      var row = document.createElement("tr");
      row.setAttribute("data-replica", r.replica_id);
      var head = document.createElement("th");
      head.setAttribute("scope", "row");
      head.textContent = r.replica_id;
      row.appendChild(head);
      cell(row, "node", plain(r.node));
      cell(row, "state", r.state + (r.is_silent ? " (silent)" : ""));
      cell(row, "tokens_in_flight", String(r.tokens_in_flight));
      cell(row, "queue_depth", String(r.queue_depth));
      cell(row, "kv_cache_usage_perc", pct(r.kv_cache_usage_perc));
      cell(row, "last_heartbeat", plain(r.last_heartbeat));
      return row;
    });
    body.replaceChildren.apply(body, rows);
  }

  function writeDecisions(decisions) {
    var body = document.querySelector("#decisions tbody");
    var rows = decisions.map(function (d) {
      var row = document.createElement("tr");
      row.setAttribute("data-decided-at", d.decided_at);
      cell(row, "decided_at", d.decided_at);
      cell(row, "replicas", d.from_replicas + " \u2192 " + d.to_replicas);
      cell(row, "reason", d.reason);
      cell(row, "utilisation", pct(d.utilisation));
      cell(row, "is_panicking", d.is_panicking ? "yes" : "no");
      cell(row, "is_capacity_exhausted", d.is_capacity_exhausted ? "yes" : "no");
      return row;
    });
    body.replaceChildren.apply(body, rows);
  }

  var chart = null;
  var canvas = document.getElementById("pool-chart");
  if (canvas && window.Chart) {
    chart = new window.Chart(canvas, {
      type: "line",
      data: {
        labels: [],
        datasets: [
          { label: "tokens in flight", data: [], borderColor: "#1f6feb", tension: 0.2 },
          {
            label: "capacity",
            data: [],
            borderColor: "#cf222e",
            borderDash: [6, 4],
            pointRadius: 0,
          },
        ],
      },
      options: {
        animation: false,
        responsive: true,
        scales: { y: { beginAtZero: true } },
      },
    });
  }

  function plot(feed) {
    if (!chart) {
      return;
    }
    var labels = chart.data.labels;
    labels.push(new Date(feed.refreshed_at).toLocaleTimeString());
    chart.data.datasets[0].data.push(feed.tokens_in_flight);
    chart.data.datasets[1].data.push(feed.capacity_tokens_in_flight);
    if (labels.length > maxPoints) {
      labels.shift();
      chart.data.datasets.forEach(function (set) {
        set.data.shift();
      });
    }
    chart.update();
  }

  // The first reading at once starts the chart; then every refreshMs.
  F.poll(root, feedUrl, refreshMs, function (feed) {
    writeSummary(feed);
    writeList(feed.warnings || []);
    writeReplicas(feed.replicas || []);
    writeDecisions(feed.decisions || []);
    plot(feed);
  }, true);
})();
