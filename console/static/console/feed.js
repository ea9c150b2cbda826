// What the console's live pages share (window.ConsoleFeed): the figures' formats,
// as console/domain/formats.py writes them, and the loop that reads a page's JSON
// feed every refreshMs. Each reading sets the root's data-refreshed-at (or, when
// the feed fails, data-error, and the next tick tries again). Pages write figures
// only as text, never as HTML.
(function () {
  "use strict";

  var NONE = "\u2014";

  function known(value) {
    return value !== null && value !== undefined;
  }

  function poll(root, feedUrl, refreshMs, write, atOnce) {
    function refresh() {
      fetch(feedUrl, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          if (!response.ok) {
            throw new Error("the feed answered " + response.status);
          }
          return response.json();
        })
        .then(function (feed) {
          write(feed);
          root.setAttribute("data-refreshed-at", feed.refreshed_at);
          root.removeAttribute("data-error");
        })
        .catch(function (error) {
          root.setAttribute("data-error", String(error));
        })
        .finally(function () {
          window.setTimeout(refresh, refreshMs);
        });
    }
    if (atOnce) {
      refresh();
    } else {
      window.setTimeout(refresh, refreshMs);
    }
  }

  window.ConsoleFeed = {
    NONE: NONE,
    known: known,
    pct: function (value) {
      return known(value) ? (value * 100).toFixed(1) + "%" : NONE;
    },
    ms: function (value) {
      return known(value) ? value.toFixed(0) + " ms" : NONE;
    },
    perSecond: function (value) {
      return known(value) ? value.toFixed(0) : NONE;
    },
    plain: function (value) {
      return known(value) && value !== "" ? String(value) : NONE;
    },
    poll: poll,
  };
})();
