// stepstone UI: saved views of the instance list, and live updates over server-sent events.
// No build step, no dependencies.
(function () {
  "use strict";
  // Saved views: named filters of the instance list, kept in this browser (localStorage).
  var box = document.querySelector("[data-views]");
  if (!box || !window.localStorage) return;
  var key = "stepstone.views", list = box.querySelector("[data-view-list]");
  function load() { try { return JSON.parse(localStorage.getItem(key) || "{}"); } catch (e) { return {}; } }
  function show() {
    var views = load(), names = Object.keys(views).sort();
    list.textContent = names.length ? "" : "none yet";
    names.forEach(function (name) {
      var a = document.createElement("a");
      a.href = window.location.pathname + views[name];
      a.textContent = name;
      var x = document.createElement("button");
      x.type = "button"; x.className = "link"; x.textContent = "×";
      x.setAttribute("aria-label", "forget the view " + name);
      x.addEventListener("click", function () { var v = load(); delete v[name]; localStorage.setItem(key, JSON.stringify(v)); show(); });
      list.appendChild(a); list.appendChild(x); list.appendChild(document.createTextNode(" "));
    });
  }
  box.querySelector("[data-save-view]").addEventListener("click", function () {
    var name = window.prompt("Name of this view");
    if (!name) return;
    var v = load(); v[name] = window.location.search.replace(/([?&])cursor=[^&]*&?/, "$1");
    localStorage.setItem(key, JSON.stringify(v)); show();
  });
  box.hidden = false;
  show();
})();

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
