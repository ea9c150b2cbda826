// The home page's refresh: every data-refresh-ms it fetches the fleet's feed
// (/console/?format=json), rewrites the cells of each pool's row and the list of
// alerts, and sets #fleet's data-refreshed-at. A pool that appears after the page
// was loaded shows on the next reload. Figures are written as
// console/domain/formats.py writes them, and only as text, never as HTML.
(function () {
  "use strict";

  var table = document.getElementById("fleet");
  if (!table || !table.getAttribute("data-feed-url")) {
    return;
  }
  var feedUrl = table.getAttribute("data-feed-url");
  var refreshMs = parseInt(table.getAttribute("data-refresh-ms"), 10) || 2000;
  var NONE = "\u2014";

  function known(value) {
    return value !== null && value !== undefined;
  }
  function pct(value) {
    return known(value) ? (value * 100).toFixed(1) + "%" : NONE;
  }
  function ms(value) {
    return known(value) ? value.toFixed(0) + " ms" : NONE;
  }
  function plain(value) {
    return known(value) && value !== "" ? String(value) : NONE;
  }
  function load(pool) {
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
      tokens.setAttribute("data-value", String(pool.tokens_in_flight));
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

  function refresh() {
    fetch(feedUrl, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) {
          throw new Error("the feed answered " + response.status);
        }
        return response.json();
      })
      .then(function (feed) {
        (feed.pools || []).forEach(writePool);
        writeAlerts(feed.alerts || []);
        table.setAttribute("data-refreshed-at", feed.refreshed_at);
        table.removeAttribute("data-error");
      })
      .catch(function (error) {
        table.setAttribute("data-error", String(error));
      })
      .finally(function () {
        window.setTimeout(refresh, refreshMs);
      });
  }

  window.setTimeout(refresh, refreshMs);
})();
