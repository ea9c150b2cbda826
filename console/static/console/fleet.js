// The home page's refresh: every data-refresh-ms it reads the fleet's feed
// (/console/?format=json, through feed.js) and rewrites the cells of each pool's
// row and the list of alerts. A pool that appears after the page was loaded shows
// on the next reload.
(function () {
  "use strict";

  var table = document.getElementById("fleet");
  if (!table || !table.getAttribute("data-feed-url")) {
    return;
  }
  var feedUrl = table.getAttribute("data-feed-url");
  var refreshMs = parseInt(table.getAttribute("data-refresh-ms"), 10) || 2000;
  var F = window.ConsoleFeed;
  var known = F.known;
  var pct = F.pct;
  var ms = F.ms;
  var plain = F.plain;

  function load(pool) {
    if (pool.kind === "embedding") {
      return (
        F.perSecond(pool.admitted_tokens_per_s) +
        " / " +
        F.perSecond(pool.capacity_tokens_per_s) +
        " input tokens/s" +
        (pool.capacity_is_assumed ? " (assumed)" : "")
      );
    }
    return (
      pool.tokens_in_flight +
      " / " +
      pool.capacity_tokens_in_flight +
      (pool.capacity_is_assumed ? " (assumed)" : "")
    );
  }
  var CELLS = {
    serving_replicas: plain,
    desired_replicas: plain,
    utilisation: pct,
    queue_depth: plain,
    ttft_p95_ms: ms,
    prefix_hit_rate: pct,
    last_reason: plain,
  };

  function writePool(pool) {
    var row = table.querySelector('tr[data-pool="' + CSS.escape(pool.pool) + '"]');
    if (!row) {
      return;
    }
    Object.keys(CELLS).forEach(function (name) {
      var cell = row.querySelector('[data-field="' + name + '"]');
      if (cell) {
        cell.textContent = CELLS[name](pool[name]);
        cell.setAttribute("data-value", known(pool[name]) ? String(pool[name]) : "");
      }
    });
    var tokens = row.querySelector('[data-field="tokens_in_flight"]');
    if (tokens) {
      tokens.textContent = load(pool);
      tokens.setAttribute(
        "data-value",
        pool.kind === "embedding"
          ? known(pool.admitted_tokens_per_s)
            ? String(pool.admitted_tokens_per_s)
            : ""
          : String(pool.tokens_in_flight)
      );
    }
  }

  function writeAlerts(alerts) {
    var list = document.getElementById("alert-list");
    var none = document.getElementById("no-alerts");
    if (!list) {
      return;
    }
    list.replaceChildren.apply(
      list,
      alerts.map(function (alert) {
        var li = document.createElement("li");
        li.setAttribute("data-alert", alert.kind);
        li.setAttribute("data-subject", alert.subject);
        var subject = document.createElement("strong");
        subject.textContent = alert.subject;
        li.appendChild(subject);
        li.appendChild(document.createTextNode(": " + alert.text));
        return li;
      })
    );
    if (none) {
      none.hidden = alerts.length > 0;
    }
  }

  F.poll(table, feedUrl, refreshMs, function (feed) {
    (feed.pools || []).forEach(writePool);
    writeAlerts(feed.alerts || []);
  }, false);
})();
