// orgchart's experiment page (GET /experiments/{key}): variants, scores, a chart of score
// against cost, and the cases that changed with a link to each diff.
// Plain JavaScript, no build step; every value from the server is inserted as text.
"use strict";

(function () {
  const token = new URLSearchParams(window.location.search).get("token");
  const query = token ? "?token=" + encodeURIComponent(token) : "";
  const SVG = "http://www.w3.org/2000/svg";

  const el = window.orgchartDom.el;

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function num(value, digits) {
    if (value === null || value === undefined) return "-";
    return Number(value).toPrecision(digits || 3).replace(/\.?0+$/, "");
  }

  function variantRow(v) {
    return el("tr", { "data-variant": v.name }, [
      el("td", { text: v.name }), el("td", { className: "num", text: v.trees }),
      el("td", { className: "num", text: v.failed }),
      el("td", { className: "num", text: v.paid_calls }),
      el("td", { className: "num", text: v.replayed_calls }),
      el("td", { className: "num", text: Number(v.cost_paid_usd).toFixed(5) }),
      el("td", { className: "num", text: Number(v.cost_replayed_usd).toFixed(5) }),
      el("td", { className: "num", text: num(v.latency_p50) }),
      el("td", { className: "num", text: num(v.latency_p90) }),
      el("td", { className: "num", text: num(v.pass_rate) })]);
  }

  function scoreCell(v, scorer) {
    const s = v.scores[scorer] || {};
    const parts = [el("div", { text: num(s.mean) + " [" + num(s.ci_low) + ", " +
      num(s.ci_high) + "]" })];
    const cmp = (v.vs_baseline || {})[scorer];
    if (cmp && cmp.diff !== null) {
      parts.push(el("div", { className: "delta-" + cmp.direction,
        text: (cmp.diff > 0 ? "+" : "") + num(cmp.diff) + " [" + num(cmp.ci_low) + ", " +
          num(cmp.ci_high) + "] p=" + num(cmp.p_value, 2) + " " + cmp.direction }));
    }
    return el("td", { "data-scorer": scorer }, parts);
  }

  function caseRow(c) {
    const link = c.baseline_root && c.root
      ? el("a", { href: "/ui/diff/" + c.baseline_root + "/" + c.root + query, text: "diff" })
      : "-";
    return el("tr", { className: c.kind, "data-kind": c.kind }, [
      el("td", { text: c.variant }), el("td", { text: c.case_name }),
      el("td", { text: c.scorer }),
      el("td", { text: num(c.baseline) + " \u2192 " + num(c.value) }),
      el("td", { text: c.kind }), el("td", {}, [link])]);
  }

  function drawChart(report, scorer) {
    const chart = document.getElementById("chart");
    const width = 560, height = 300, pad = 60;
    const points = report.variants.map((v) => ({
      name: v.name, y: (v.scores[scorer] || {}).mean,
      x: v.trees ? (Number(v.cost_paid_usd) + Number(v.cost_replayed_usd)) / v.trees : 0,
      paid: v.trees ? Number(v.cost_paid_usd) / v.trees : 0 }))
      .filter((p) => p.y !== null && p.y !== undefined);
    const xs = points.flatMap((p) => [p.x, p.paid]);
    const ys = points.map((p) => p.y);
    const span = (lo, hi) => (hi > lo ? [lo, hi] : [lo - 1, hi + 1]);
    const [x0, x1] = span(Math.min(0, ...xs), Math.max(...xs, 0));
    const [y0, y1] = span(Math.min(...ys, 0), Math.max(...ys, 0));
    const sx = (x) => pad + (x - x0) / (x1 - x0) * (width - 2 * pad);
    const sy = (y) => height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad);
    chart.replaceChildren(
      svg("line", { x1: pad, y1: height - pad, x2: width - pad, y2: height - pad,
        class: "axis" }),
      svg("line", { x1: pad, y1: pad, x2: pad, y2: height - pad, class: "axis" }),
      svg("text", { x: width / 2, y: height - 10, "text-anchor": "middle" },
        "$ per tree (hollow: paid; filled: standing alone)"),
      svg("text", { x: 12, y: pad - 12 }, scorer),
      svg("text", { x: pad, y: height - pad + 16, "text-anchor": "middle" }, num(x0)),
      svg("text", { x: width - pad, y: height - pad + 16, "text-anchor": "middle" }, num(x1)),
      svg("text", { x: pad - 6, y: sy(y0), "text-anchor": "end" }, num(y0)),
      svg("text", { x: pad - 6, y: sy(y1), "text-anchor": "end" }, num(y1)),
      ...points.flatMap((p, i) => [
        svg("circle", { cx: sx(p.paid), cy: sy(p.y), r: 5, class: "point-paid",
          "data-variant": p.name }),
        svg("circle", { cx: sx(p.x), cy: sy(p.y), r: 6, class: "point",
          "data-variant": p.name }),
        svg("text", { x: sx(p.x) + 9, y: sy(p.y) - 8 + 14 * i, class: "label" }, p.name)]));
  }

  async function load() {
    const key = document.body.dataset.key;
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const response = await fetch("/experiments/" + encodeURIComponent(key),
      { headers: headers, cache: "no-store" });
    const report = await response.json();
    if (!response.ok) {
      const message = document.getElementById("message");
      message.textContent = report.error || "HTTP " + response.status;
      message.hidden = false;
      return;
    }
    document.getElementById("name").textContent = report.name;
    document.getElementById("summary").textContent = report.status + " \u00b7 dataset " +
      report.dataset.name + " " + report.dataset.version + ": " + report.dataset.cases +
      " cases x " + report.repeat + (report.note ? " \u00b7 " + report.note : "");
    document.querySelector("#variants tbody").replaceChildren(...report.variants.map(variantRow));
    document.querySelector("#scores thead tr").replaceChildren(el("th", { text: "scorer" }),
      ...report.variants.map((v) => el("th", { text: v.name })));
    document.querySelector("#scores tbody").replaceChildren(...report.scorers.map((s) =>
      el("tr", { "data-scorer": s }, [el("td", { text: s }),
        ...report.variants.map((v) => scoreCell(v, s))])));
    document.querySelector("#cases tbody").replaceChildren(...report.cases.map(caseRow));
    const select = document.getElementById("chart-scorer");
    select.replaceChildren(...report.scorers.map((s) => el("option", { value: s, text: s })));
    const first = report.scorers.includes("verdict") ? "verdict" : report.scorers[0];
    if (first) {
      select.value = first;
      drawChart(report, first);
    }
    select.addEventListener("change", () => drawChart(report, select.value));
    document.body.dataset.loaded = "true";
  }

  document.addEventListener("DOMContentLoaded", load);
})();
