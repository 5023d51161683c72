// orgchart's web pages: the index of recent roots and the live task tree.
// Plain JavaScript, no build step. Every value from the server is inserted with
// textContent (never as HTML). When the server wants a bearer token, open the page with
// ?token=<token>: it is sent on every fetch as "Authorization: Bearer <token>".
"use strict";

(function () {
  const TERMINAL = new Set(["done", "failed", "escalated"]);
  const POLL_MS = 1000;
  const INDEX_POLL_MS = 5000;
  const token = new URLSearchParams(window.location.search).get("token");
  const tokenQuery = token ? "?token=" + encodeURIComponent(token) : "";

  // ------------------------------------------------------------------ helpers
  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const init = { method: method, headers: headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try {
      data = await response.json();
    } catch (e) {
      data = null;
    }
    if (!response.ok) {
      const error = new Error(data && data.error ? data.error : "HTTP " + response.status);
      error.status = response.status;
      throw error;
    }
    return data;
  }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "className") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children || []) {
      if (child !== null && child !== undefined && child !== false) node.append(child);
    }
    return node;
  }

  function statusBadge(status) {
    return el("span", { className: "status", "data-status": status, text: status });
  }

  function usd(value) {
    const n = Number(value || 0);
    return "$" + (n === 0 ? "0" : n < 0.01 ? n.toFixed(6) : n.toFixed(4));
  }

  function seconds(value) {
    const n = Number(value || 0);
    return n < 10 ? n.toFixed(2) + " s" : n.toFixed(1) + " s";
  }

  function when(iso) {
    return iso ? new Date(iso).toLocaleString() : "";
  }

  function goalOf(task) {
    const payload = task.payload || {};
    return typeof payload.goal === "string" ? payload.goal : "";
  }

  function showMessage(text, kind) {
    const box = document.getElementById("message");
    if (!box) return;
    box.hidden = !text;
    box.textContent = text || "";
    box.className = "message" + (kind ? " " + kind : "");
    box.dataset.kind = kind || "";
  }

  function stamp() {
    const updated = document.getElementById("updated");
    if (updated) updated.textContent = "updated " + new Date().toLocaleTimeString();
  }

  // ------------------------------------------------------------------ index page
  async function refreshIndex() {
    try {
      const roots = await api("GET", "/roots?limit=100");
      const body = document.querySelector("#roots tbody");
      body.replaceChildren(
        ...roots.map((t) =>
          el("tr", { "data-task-id": t.id, "data-status": t.status }, [
            el("td", {}, [statusBadge(t.status)]),
            el("td", { className: "goal-cell" }, [
              el("a", { href: "/ui/trees/" + t.id + tokenQuery, text: goalOf(t) || "(no goal)" }),
            ]),
            el("td", { text: t.agent }),
            el("td", { className: "num", text: t.spent_tokens }),
            el("td", { className: "num", text: usd(t.spent_usd) }),
            el("td", { text: when(t.created_at) }),
            el("td", {}, [el("code", { text: t.id })]),
          ])
        )
      );
      document.getElementById("empty").hidden = roots.length > 0;
      showMessage("");
      stamp();
    } catch (error) {
      showMessage(error.message, "error");
      if (error.status === 401) return;
    }
    window.setTimeout(refreshIndex, INDEX_POLL_MS);
  }

  // ------------------------------------------------------------------ tree page
  const state = { rootId: null, lastText: null, timer: null };

  function verdictText(verdict) {
    if (!verdict) return null;
    const score = verdict.score === undefined || verdict.score === null
      ? "" : " " + Number(verdict.score).toFixed(2);
    return "verdict " + (verdict.passed ? "pass" : "fail") + score;
  }

  function details(key, label, value) {
    if (value === null || value === undefined) return null;
    return el("details", { "data-key": key }, [
      el("summary", { text: label }),
      el("pre", { text: JSON.stringify(value, null, 2) }),
    ]);
  }

  function actions(node) {
    if (node.status !== "escalated") return null;
    const buttons = [
      ["retry", "Retry"],
      ["done", "Done"],
      ["fail", "Fail"],
    ].map(([action, label]) =>
      el("button", {
        type: "button",
        className: "resolve " + action,
        "data-action": action,
        "data-task-id": node.id,
        text: label,
        onclick: () => resolve(node.id, action),
      })
    );
    return el("div", { className: "actions" }, [
      el("span", { className: "hint", text: "needs a person:" }),
      ...buttons,
    ]);
  }

  function renderNode(node) {
    const verdict = verdictText(node.verdict);
    const goal = node.parent_id ? goalOf(node) : ""; // the root's goal heads the page
    const line = el("div", { className: "line" }, [
      statusBadge(node.status),
      el("span", { className: "agent", text: node.agent }),
      el("span", { className: "type", text: node.type }),
      el("span", { className: "spend", title: "subtree spend (own: " + node.own_tokens +
        " tokens, " + usd(node.own_usd) + ")",
        text: node.spent_tokens + " tok · " + usd(node.spent_usd) }),
      el("span", { className: "duration", text: seconds(node.duration_seconds) }),
      node.route ? el("span", { className: "route", text: node.route + ":" + node.model }) : null,
      verdict ? el("span", { className: "verdict " + (node.verdict.passed ? "pass" : "fail"),
        text: verdict }) : null,
      el("code", { className: "id", title: node.id, text: node.id.slice(0, 8) }),
    ]);
    const children = node.children || [];
    return el("li", { className: "node", "data-task-id": node.id, "data-status": node.status }, [
      line,
      goal ? el("div", { className: "node-goal", text: goal }) : null,
      node.error ? el("div", { className: "error", text: node.error }) : null,
      actions(node),
      el("div", { className: "extras" }, [
        details("result-" + node.id, "result", node.result),
        node.verdict && node.verdict.reasons && node.verdict.reasons.length
          ? details("verdict-" + node.id, "verdict reasons", node.verdict.reasons) : null,
        details("payload-" + node.id, "payload", node.payload),
      ]),
      children.length ? el("ul", {}, children.map(renderNode)) : null,
    ]);
  }

  function renderTree(tree) {
    const container = document.getElementById("tree");
    const open = new Set(
      Array.from(container.querySelectorAll("details[open]")).map((d) => d.dataset.key)
    );
    container.replaceChildren(el("ul", { className: "root" }, [renderNode(tree)]));
    for (const d of container.querySelectorAll("details")) {
      if (open.has(d.dataset.key)) d.open = true;
    }
    container.dataset.status = tree.status;
    const badge = document.getElementById("root-status");
    badge.textContent = tree.status;
    badge.dataset.status = tree.status;
    document.getElementById("goal").textContent = goalOf(tree);
    const t = tree.totals || {};
    const byStatus = Object.entries(t.by_status || {})
      .sort()
      .map(([status, n]) => status + " " + n)
      .join(", ");
    document.getElementById("totals").textContent =
      (t.tasks || 0) + " tasks (" + byStatus + ") · " + (t.spent_tokens || 0) + " tokens · " +
      usd(t.spent_usd) + " · " + seconds(t.duration_seconds) + " of work";
    document.title = "orgchart: " + tree.status + " " + (goalOf(tree) || state.rootId);
  }

  async function refreshTree() {
    state.timer = null;
    try {
      const tree = await api("GET", "/trees/" + state.rootId);
      const text = JSON.stringify(tree);
      if (text !== state.lastText) {
        state.lastText = text;
        renderTree(tree);
      }
      const box = document.getElementById("message");
      if (box.dataset.kind === "error") showMessage("");
      stamp();
      if (TERMINAL.has(tree.status)) {
        document.getElementById("updated").textContent += " (finished: no longer polling)";
        return;
      }
    } catch (error) {
      showMessage(error.message, "error");
      if (error.status === 401 || error.status === 404 || error.status === 422) {
        const badge = document.getElementById("root-status");
        badge.textContent = "unavailable";
        badge.dataset.status = "unavailable";
        return;
      }
    }
    schedule(POLL_MS);
  }

  function schedule(ms) {
    if (state.timer !== null) window.clearTimeout(state.timer);
    state.timer = window.setTimeout(refreshTree, ms);
  }

  async function resolve(taskId, action) {
    for (const b of document.querySelectorAll("button.resolve")) b.disabled = true;
    try {
      const task = await api("POST", "/tasks/" + taskId + "/resolve", {
        action: action,
        note: "resolved from the web page",
      });
      showMessage("task " + taskId.slice(0, 8) + " resolved (" + action + "): now " +
        task.status, "ok");
    } catch (error) {
      showMessage("could not resolve " + taskId.slice(0, 8) + ": " + error.message, "error");
      for (const b of document.querySelectorAll("button.resolve")) b.disabled = false;
    }
    schedule(0);
  }

  // ------------------------------------------------------------------ start
  document.addEventListener("DOMContentLoaded", () => {
    const page = document.body.dataset.page;
    if (page === "index") {
      refreshIndex();
    } else if (page === "tree") {
      state.rootId = document.body.dataset.rootId;
      refreshTree();
    }
  });
})();
