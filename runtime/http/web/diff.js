// orgchart's diff page: two trees side by side, task by task (GET /diff/{a}/{b}).
// Plain JavaScript, no build step; every value from the server is inserted as text.
"use strict";

(function () {
  const token = new URLSearchParams(window.location.search).get("token");

  const el = window.orgchartDom.el;

  function signed(value, digits, unit) {
    const n = Number(value || 0);
    if (n === 0) return el("span", { text: "=" });
    const text = (n > 0 ? "+" : "") + n.toFixed(digits) + (unit || "");
    return el("span", { className: n > 0 ? "delta-up" : "delta-down", text: text });
  }

  function status(value) {
    return el("span", { className: "status", "data-status": value, text: value });
  }

  function verdict(side) {
    const v = side && side.verdict;
    if (!v) return "-";
    return (v.passed ? "pass" : "fail") + (v.score === undefined ? "" : " " + v.score);
  }

  function calls(side) {
    if (!side) return "-";
    return side.calls_paid + " paid, " + side.calls_replayed + " replayed";
  }

  function stamps(pair) {
    const changed = pair.changed || {};
    const out = [];
    if (changed.version) out.push(el("span", { className: "stamp-changed", text: "version" }));
    if (changed.prompts) out.push(el("span", { className: "stamp-changed", text: "prompts" }));
    if (!out.length) out.push(el("span", { text: "same" }));
    return out;
  }

  function resultDiff(lines) {
    if (!lines.length) return el("span", { text: "same" });
    return el("pre", { className: "result-diff" }, lines.map((line) => el("span", {
      className: line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : null,
      text: line + "\n" })));
  }

  function row(pair) {
    const a = pair.a;
    const b = pair.b;
    const one = b || a;
    if (pair.only_in) {
      return el("tr", { className: "changed", "data-path": pair.path }, [
        el("td", { className: "path", text: pair.path }), el("td", { text: one.agent }),
        el("td", { colspan: 9, text: "only in " + pair.only_in.toUpperCase() + " (" +
          one.status + ")" })]);
    }
    const changed = pair.changed;
    const any = changed.status || changed.result || changed.verdict || changed.version ||
      changed.prompts;
    return el("tr", { className: any ? "changed" : "", "data-path": pair.path }, [
      el("td", { className: "path", text: pair.path }),
      el("td", { text: b.agent }),
      el("td", {}, a.status === b.status ? [status(b.status)]
        : [status(a.status), " \u2192 ", status(b.status)]),
      el("td", { className: "num" }, [a.own_tokens + " \u2192 " + b.own_tokens + " ",
        signed(pair.delta.own_tokens, 0)]),
      el("td", { className: "num" }, [signed(pair.delta.own_usd, 6, "")]),
      el("td", { className: "num" }, [signed(pair.delta.duration_seconds, 2, " s")]),
      el("td", { text: calls(a) }),
      el("td", { className: "calls-b", text: calls(b) }),
      el("td", {}, stamps(pair)),
      el("td", { text: verdict(a) === verdict(b) ? verdict(b) : verdict(a) + " \u2192 " +
        verdict(b) }),
      el("td", {}, [resultDiff(pair.result_diff)]),
    ]);
  }

  async function load() {
    const a = document.body.dataset.a;
    const b = document.body.dataset.b;
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const response = await fetch("/diff/" + a + "/" + b, { headers: headers, cache: "no-store" });
    const data = await response.json();
    if (!response.ok) {
      const message = document.getElementById("message");
      message.textContent = data.error || "HTTP " + response.status;
      message.hidden = false;
      return;
    }
    const ta = data.totals.a;
    const tb = data.totals.b;
    document.getElementById("totals").textContent =
      "A: " + ta.tasks + " tasks, " + ta.own_tokens + " tokens, $" + ta.own_usd + ", " +
      ta.calls_paid + " calls paid \u00b7 B: " + tb.tasks + " tasks, " + tb.own_tokens +
      " tokens, $" + tb.own_usd + ", " + tb.calls_paid + " calls paid, " +
      tb.calls_replayed + " replayed";
    document.querySelector("#diff tbody").replaceChildren(...data.pairs.map(row));
    document.body.dataset.loaded = "true";
  }

  document.addEventListener("DOMContentLoaded", load);
})();
