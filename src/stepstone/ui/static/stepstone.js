// stepstone UI: live updates over server-sent events, nothing else. No build step, no dependencies.
// <main data-live="list"> refreshes when any instance settles; <main data-live="<instance id>"> when
// that instance changes. A refresh fetches the page again and swaps <main>'s content in place.
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  if (!main || !window.EventSource || !window.fetch) return;
  var live = main.getAttribute("data-live");
  var base = document.querySelector("a.brand").getAttribute("href").replace(/\/$/, "");
  var stamp = main.getAttribute("data-stamp") || "";
  var url = base + "/events" + (live === "list" ? "" :
    "?instance=" + encodeURIComponent(live) + "&stamp=" + encodeURIComponent(stamp));
  var pending = null, last = 0;

  function refresh() {
    pending = null;
    last = Date.now();
    fetch(window.location.href, {credentials: "same-origin", headers: {"X-Stepstone-Refresh": "1"}})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
        if (fresh) { main.innerHTML = fresh.innerHTML; main.setAttribute("data-refreshed", String(Date.now())); }
      })
      .catch(function () {});
  }

  function schedule() {
    if (pending) return;
    pending = setTimeout(refresh, Math.max(0, 1000 - (Date.now() - last)));
  }

  var source = new EventSource(url);
  source.addEventListener("changed", schedule);
  window.addEventListener("beforeunload", function () { source.close(); });
})();
