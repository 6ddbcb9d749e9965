// codex-failover's dashboard: polls /view.json (the view model, core/dashboard.py) and puts its
// strings where they go. No library, no inline code (the page's Content-Security-Policy forbids it).
"use strict";
(function () {
  const EVERY = 3000;
  let last = null;

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "style-width") e.style.width = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined && c !== "") e.append(c instanceof Node ? c : String(c));
    return e;
  }

  function account(c) {
    const card = el("div", { class: "card", "data-name": c.name });
    card.append(el("div", { class: "top" },
      el("span", { class: "name" }, c.name, el("span", { class: "kind" }, c.kind || "")),
      el("span", { class: "badge " + c.badge }, c.state + (c.rest_left ? " · " + c.rest_left + " left" : ""))));
    card.append(el("div", { class: "why" }, c.why));
    for (const w of c.windows) {
      card.append(el("div", { class: "window" },
        el("div", { class: "label" }, el("span", {}, w.label + " · " + w.text), el("span", { class: "muted" }, w.resets)),
        el("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(w.percent), "aria-label": c.name + " " + w.label },
          el("div", { class: w.full ? "full" : "", "style-width": w.percent + "%" }))));
    }
    const meta = [c.usage_note, c.token, c.seen, c.ended].filter(Boolean).join(" · ");
    if (meta) card.append(el("div", { class: "meta" }, meta));
    if (c.resettable) {
      const b = el("button", { type: "button", "data-reset": c.reset }, "end rest now");
      b.addEventListener("click", () => reset(c.reset, b));
      card.append(b);
    }
    return card;
  }

  async function reset(name, button) {
    button.disabled = true;
    try {
      const r = await fetch("/reset/" + encodeURIComponent(name), {
        method: "POST", headers: { "X-Codex-Failover": "1" }, credentials: "omit", cache: "no-store" });
      const doc = await r.json().catch(() => ({}));
      button.textContent = r.ok ? "done" : "refused (" + r.status + ")";
      button.title = doc.result || doc.error || "";
    } catch (e) {
      button.textContent = "failed";
    }
    refresh();
  }

  function request(r, filter) {
    const attempts = el("td", {});
    for (const a of r.attempts) attempts.append(el("span", { class: "att " + (a.ok ? "ok" : "no") }, a.text));
    const tr = el("tr", { "data-id": r.id },
      el("td", { class: "num" }, r.time), el("td", {}, el("code", {}, r.session)), el("td", {}, r.model),
      el("td", {}, r.transport), attempts,
      el("td", { class: r.moved ? "moved" : "" }, r.result),
      el("td", { class: "num" }, r.first_output), el("td", { class: "num" }, r.tokens));
    if (filter && !tr.textContent.toLowerCase().includes(filter)) tr.hidden = true;
    return tr;
  }

  function render(v) {
    document.getElementById("pool").textContent = "pool: " + v.pool;
    if (v.proxy) document.getElementById("as-json").textContent = "curl -x http://" + v.proxy + " http://codex-failover.status/";
    document.getElementById("accounts").replaceChildren(...v.credentials.map(account));
    document.getElementById("counts").replaceChildren(...v.counts.map(c =>
      el("div", { class: "count", title: c.hint || "" }, el("div", { class: "v" }, c.value), el("div", { class: "l" }, c.label))));
    document.getElementById("rejections").textContent = v.rejections.length
      ? "attempts that did not serve, by reason: " + v.rejections.map(r => r.reason + " " + r.count).join(", ") : "";
    const routes = document.getElementById("routes");
    routes.replaceChildren(...v.routes.map(r => el("li", {}, el("span", { class: r.ok ? "up" : "down" }, r.ok ? "● " : "▲ "), r.endpoint + ": " + r.state)));
    document.getElementById("routes-section").hidden = v.routes.length === 0;
    const filter = document.getElementById("filter").value.trim().toLowerCase();
    const rows = v.recent.map(r => request(r, filter));
    document.getElementById("recent").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "8", class: "muted" }, "no model request yet"))]));
    document.getElementById("internals").textContent = JSON.stringify(v.internals, null, 2);
  }

  async function refresh() {
    try {
      const r = await fetch("/view.json", { headers: { Accept: "application/json" }, cache: "no-store", credentials: "omit" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      last = await r.json();
      render(last);
      document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      document.getElementById("updated").textContent = "not updated: " + e.message;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("filter").addEventListener("input", () => { if (last) render(last); });
    refresh();
    setInterval(refresh, EVERY);
  });
})();
