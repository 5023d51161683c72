// orgchart's web pages: the index of recent roots and the live task tree.
// Plain JavaScript, no build step. Every value from the server is inserted with
// textContent (never as HTML). When the server wants a bearer token, open the page with
// ?token=<token>: it is sent on every fetch as "Authorization: Bearer <token>".
"use strict";

(function () {
  const TERMINAL = new Set(["done", "failed", "escalated", "cancelled"]);
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

  const el = window.orgchartDom.el;

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
    if (typeof task.goal === "string") return task.goal; // the tree's summary shape
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
  const state = { rootId: null, lastText: null, timer: null, tree: null, nodes: new Map(),
                  cursor: 0, polls: 0, finalRead: false, details: new Map(), rootGoal: null };

  // The tree is read in its summary shape (no payload, result or verdict reasons); a
  // node's whole row is read with GET /tasks/{id} when its details are opened.
  function verdictOf(node) {
    if (node.verdict) return node.verdict;
    if (node.verdict_passed === undefined || node.verdict_passed === null) return null;
    return { passed: node.verdict_passed, score: node.verdict_score };
  }

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

  function extras(node) {
    const full = node.payload !== undefined ? node : state.details.get(node.id);
    if (full) {
      return el("div", { className: "extras" }, [
        details("result-" + node.id, "result", full.result),
        full.verdict && full.verdict.reasons && full.verdict.reasons.length
          ? details("verdict-" + node.id, "verdict reasons", full.verdict.reasons) : null,
        details("payload-" + node.id, "payload", full.payload),
      ]);
    }
    const box = el("details", { className: "more", "data-key": "more-" + node.id }, [
      el("summary", { text: node.has_result ? "result, payload" : "payload" }),
    ]);
    box.addEventListener("toggle", async () => {
      if (!box.open || box.dataset.loading) return;
      box.dataset.loading = "1";
      try {
        const task = await api("GET", "/tasks/" + node.id);
        state.details.set(node.id, task);
        box.parentElement.replaceWith(extras(node));
        for (const d of document.querySelectorAll('li.node[data-task-id="' + node.id +
            '"] > .extras > details')) d.open = true;
      } catch (error) {
        box.append(el("div", { className: "error", text: "could not read the task: " +
          error.message }));
        delete box.dataset.loading;
      }
    });
    return el("div", { className: "extras" }, [box]);
  }

  // Which backend(s) served a task's calls, as `orgchart tree` says it (render.py
  // served_text): "offline (est.)" when its cost is the price of a model that did not run.
  const NOT_RUN_BACKENDS = ["offline", "replay"];
  function servedText(node) {
    const served = node.served_by || {};
    const backends = Object.keys(served).sort();
    if (!backends.length) return "";
    let text;
    if (backends.length === 1) {
      text = backends[0];
      if (!NOT_RUN_BACKENDS.includes(text) && node.route) text += " " + node.route + ":" + node.model;
    } else {
      text = backends.map((b) => b + " " + served[b]).join(", ");
    }
    return text + (node.cost_estimated ? " (est.)" : "");
  }

  function servedTotalsText(t) {
    const served = t.served_by || {};
    const backends = Object.keys(served).sort();
    if (!backends.length) return "";
    let text = " · served by " + backends.map((b) => b + " " + served[b] +
      (served[b] === 1 ? " call" : " calls")).join(", ");
    if (Number(t.estimated_usd || 0)) text += " (" + usd(t.estimated_usd) + " est.)";
    return text;
  }

  function renderNode(node) {
    const verdictValue = verdictOf(node);
    const verdict = verdictText(verdictValue);
    const goal = node.parent_id ? goalOf(node) : ""; // the root's goal heads the page
    const line = el("div", { className: "line" }, [
      statusBadge(node.status),
      el("span", { className: "agent", text: node.agent }),
      el("span", { className: "type", text: node.type }),
      el("span", { className: "spend", title: "subtree spend (own: " + node.own_tokens +
        " tokens, " + usd(node.own_usd) + ")",
        text: node.spent_tokens + " tok · " + usd(node.spent_usd) }),
      el("span", { className: "duration", text: seconds(node.duration_seconds) }),
      servedText(node) ? el("span", {
        className: "served" + (node.cost_estimated ? " estimated" : ""),
        title: node.cost_estimated
          ? "an estimate: the configured price of " + node.model + ", which did not run (budgets count it)"
          : "the backend that served this task's model calls",
        text: servedText(node) }) : null,
      verdict ? el("span", { className: "verdict " + (verdictValue.passed ? "pass" : "fail"),
        text: verdict }) : null,
      el("code", { className: "id", title: node.id, text: node.id.slice(0, 8) }),
    ]);
    const children = node.children || [];
    return el("li", { className: "node", "data-task-id": node.id, "data-status": node.status }, [
      line,
      goal ? el("div", { className: "node-goal", text: goal }) : null,
      liveTextOf(node),
      node.error ? el("div", { className: "error", text: node.error }) : null,
      actions(node),
      extras(node),
      stepsDetails(node),
      children.length ? childList(node, children) : null,
    ]);
  }

  // ------------------------------------------------------------------ live text
  // The model calls' text as it streams: GET /trees/{id}/stream (Server-Sent Events;
  // EventSource resumes with Last-Event-ID by itself). Each open task shows the text of
  // its current call (the newest call and attempt), the last LIVE_CHARS characters.
  const LIVE_CHARS = 4000;
  const live = new Map(); // task id -> { key, label, text, done }

  function liveTextOf(node) {
    const entry = live.get(node.id);
    if (!entry || TERMINAL.has(node.status)) return null;
    return el("div", { className: "live-text", "data-call": entry.label }, [
      el("span", { className: "live-label", text: entry.label }),
      el("pre", { className: "live-body", text: entry.text.slice(-LIVE_CHARS) }),
    ]);
  }

  function showLiveText(taskId) {
    const li = document.querySelector('li.node[data-task-id="' + taskId + '"]');
    if (!li || TERMINAL.has(li.dataset.status)) return;
    const fresh = liveTextOf({ id: taskId, status: li.dataset.status });
    const old = li.querySelector(":scope > .live-text");
    if (old && fresh) old.replaceWith(fresh);
    else if (fresh) li.querySelector(":scope > .line").after(fresh);
  }

  function onText(data) {
    const key = data.phase + "/" + data.call + "/" + data.attempt;
    let entry = live.get(data.task_id);
    if (!entry || entry.key !== key) {
      // A newer attempt that resumes a call cut off starts at its offset: the older
      // attempt's text up to there is its own too.
      const sameCall = entry && entry.key.startsWith(data.phase + "/" + data.call + "/");
      entry = { key: key, text: sameCall ? entry.text.slice(0, data.offset) : "",
        label: data.phase + " call " + data.call +
          (data.attempt > 1 ? ", attempt " + data.attempt : "") };
      live.set(data.task_id, entry);
    }
    if (data.offset > entry.text.length) return; // not the next piece of this attempt
    entry.text = entry.text.slice(0, data.offset) + data.text;
    showLiveText(data.task_id);
  }

  function followText() {
    if (typeof EventSource === "undefined") return;
    const source = new EventSource("/trees/" + state.rootId + "/stream" + tokenQuery);
    source.addEventListener("text", (e) => onText(JSON.parse(e.data)));
    source.addEventListener("superseded", (e) => {
      const data = JSON.parse(e.data);
      const entry = live.get(data.task_id);
      if (entry && entry.key === data.phase + "/" + data.call + "/" + data.attempt) {
        entry.label += " (superseded by attempt " + data.by + ")";
        showLiveText(data.task_id);
      }
    });
    source.addEventListener("end", () => source.close());
  }

  // A task's durable steps and tool calls, read from GET /tasks/{id} when opened.
  function stepsDetails(node) {
    const box = el("details", { className: "steps", "data-key": "steps-" + node.id }, [
      el("summary", { text: "steps and tool calls" }),
    ]);
    box.addEventListener("toggle", async () => {
      if (!box.open || box.dataset.loaded) return;
      box.dataset.loaded = "1";
      try {
        const task = await api("GET", "/tasks/" + node.id);
        box.append(stepsList(task.steps || []));
      } catch (error) {
        box.append(el("div", { className: "error", text: "steps unavailable: " + error.message }));
      }
    });
    return box;
  }

  function stepsList(steps) {
    if (!steps.length) return el("div", { className: "hint", text: "none" });
    return el("ul", { className: "step-list" }, steps.map((s) => el("li", {
      "data-kind": s.kind, "data-status": s.status }, [
      el("code", { text: s.tool_call_id || s.position }),
      el("span", { className: "step-name", text: s.kind + " " + s.name }),
      el("span", { className: "step-args", text: s.args || "" }),
      el("span", { className: s.error ? "error" : "step-result",
        text: s.error || (s.result === null ? "-" : s.result) }),
      el("span", { className: "duration", text: seconds(s.duration_seconds || 0) }),
      el("span", { className: "hint", text: (s.replays ? "replayed " + s.replays + "x " : "")
        + (s.starts > 1 ? "ran " + s.starts + "x" : "") + (s.status === "started"
          ? " unfinished" : "") }),
    ])));
  }

  // Big trees draw their first two levels; deeper children are drawn when opened.
  const BIG_TREE = 200;

  function childList(node, children) {
    const total = (state.tree && state.tree.totals && state.tree.totals.tasks) || 0;
    if (total <= BIG_TREE || node.depth < 1) return el("ul", {}, children.map(renderNode));
    const box = el("details", { className: "kids", "data-key": "kids-" + node.id }, [
      el("summary", { text: children.length + (children.length === 1 ? " child" : " children") }),
    ]);
    box.addEventListener("toggle", () => {
      if (box.open && box.children.length === 1) box.append(el("ul", {}, children.map(renderNode)));
    });
    return box;
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
    document.getElementById("goal").textContent = state.rootGoal || goalOf(tree);
    if (!state.rootGoal && typeof tree.goal === "string" && tree.goal.length >= 200) {
      // the summary cuts a goal at 200 characters: the page's heading reads it whole
      api("GET", "/tasks/" + state.rootId).then((root) => {
        state.rootGoal = (root.payload && root.payload.goal) || tree.goal;
        document.getElementById("goal").textContent = state.rootGoal;
      }).catch(() => {});
    }
    showOrigin(tree);
    const t = tree.totals || {};
    const byStatus = Object.entries(t.by_status || {})
      .sort()
      .map(([status, n]) => status + " " + n)
      .join(", ");
    document.getElementById("totals").textContent = "tenant " + (tree.tenant || "default") +
      " · " + (t.tasks || 0) + " tasks (" + byStatus + ") · " + (t.spent_tokens || 0) + " tokens · " +
      usd(t.spent_usd) + " · " + seconds(t.duration_seconds) + " of work" + servedTotalsText(t);
    document.title = "orgchart: " + tree.status + " " + (goalOf(tree) || state.rootId);
  }

  // A branch (orgchart fork) names the tree it came from; either side links to the diff.
  function diffLink(a, b, text) {
    return el("a", { href: "/ui/diff/" + a + "/" + b + tokenQuery, className: "diff-link",
      text: text });
  }

  function showOrigin(tree) {
    const origin = document.getElementById("origin");
    if (tree.forked_from && origin.hidden) {
      origin.replaceChildren("branch of ",
        el("a", { href: "/ui/trees/" + tree.forked_from + tokenQuery,
          text: tree.forked_from.slice(0, 8) }), " ",
        diffLink(tree.forked_from, tree.id, "compare with the original"));
      origin.hidden = false;
      api("GET", "/tasks/" + tree.id).then((root) => {  // the note (the summary has none)
        const note = root.fork && root.fork.note;
        if (note) origin.insertBefore(document.createTextNode("(" + note + ") "),
          origin.lastChild);
      }).catch(() => {});
    }
    if (!state.branchesRead) {
      state.branchesRead = true;
      api("GET", "/tasks/" + tree.id + "/forks").then((branches) => {
        if (!branches || !branches.length) return;
        const box = document.getElementById("branches");
        box.replaceChildren("branches: ");
        for (const b of branches) {
          box.append(el("a", { href: "/ui/trees/" + b.id + tokenQuery, text: b.id.slice(0, 8) }),
            " ", statusBadge(b.status), diffLink(tree.id, b.id, "compare"), " ");
        }
        box.hidden = false;
      }).catch(() => { state.branchesRead = false; });
    }
  }

  // The page reads the whole tree once, then follows it by what changed
  // (GET /trees/{id}/events?after=<last event id>): changed tasks are patched into the
  // tree in memory. A full read again every FULL_EVERY polls, and once at the end,
  // picks up what the change feed does not carry (spend rolled up into ancestors).
  const FULL_EVERY = 30;
  const TIMELINE_MS = 2000;

  async function fetchTree() {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const response = await fetch("/trees/" + state.rootId + "?fields=summary",
      { headers: headers, cache: "no-store" });
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
    state.cursor = Number(response.headers.get("X-Orgchart-Last-Event") || 0);
    state.polls = 0;
    adoptTree(data);
  }

  function adoptTree(tree) {
    state.tree = tree;
    state.nodes = new Map();
    const stack = [tree];
    while (stack.length) {
      const node = stack.pop();
      state.nodes.set(node.id, node);
      for (const child of node.children || []) stack.push(child);
    }
  }

  // The summary shape has no created_at: nodes read whole come first (they are older
  // than any child the change feed adds), in the order the server sent them.
  function byCreation(a, b) {
    const x = a.created_at || "";
    const y = b.created_at || "";
    if (!x || !y) return (x ? 1 : 0) - (y ? 1 : 0);
    return x < y ? -1 : x > y ? 1 : a.id < b.id ? -1 : a.id > b.id ? 1 : 0;
  }

  // Patch changed tasks into the tree; false when one cannot be placed (read it all).
  function applyChanges(tasks) {
    for (const task of tasks) {
      state.details.delete(task.id); // read again when opened
      const known = state.nodes.get(task.id);
      if (known) {
        for (const [key, value] of Object.entries(task)) {
          if (key !== "children" && key !== "totals") known[key] = value;
        }
        continue;
      }
      const parent = state.nodes.get(task.parent_id);
      if (!parent) return false;
      const node = Object.assign({}, task, { children: [] });
      parent.children.push(node);
      parent.children.sort(byCreation);
      state.nodes.set(node.id, node);
    }
    const totals = { tasks: 0, by_status: {}, spent_tokens: 0, spent_usd: 0, duration_seconds: 0,
      served_by: {}, estimated_usd: 0 };
    for (const node of state.nodes.values()) {
      for (const [backend, calls] of Object.entries(node.served_by || {})) {
        totals.served_by[backend] = (totals.served_by[backend] || 0) + calls;
      }
      if (node.cost_estimated) totals.estimated_usd += Number(node.own_usd || 0);
      totals.tasks += 1;
      totals.by_status[node.status] = (totals.by_status[node.status] || 0) + 1;
      totals.spent_tokens += Number(node.own_tokens || 0);
      totals.spent_usd += Number(node.own_usd || 0);
      totals.duration_seconds += Number(node.duration_seconds || 0);
    }
    state.tree.totals = totals;
    return true;
  }

  async function follow() {
    for (;;) {
      const changes = await api("GET", "/trees/" + state.rootId + "/events?after=" + state.cursor);
      state.cursor = changes.last_event_id;
      if (changes.tasks.length && !applyChanges(changes.tasks)) {
        await fetchTree();
        return true;
      }
      if (!changes.more) return changes.tasks.length > 0;
    }
  }

  async function refreshTree() {
    state.timer = null;
    try {
      let changed;
      let whole = false;
      if (state.tree === null || state.polls >= FULL_EVERY) {
        if (state.tree === null) scheduleTimeline(0); // in parallel with the first read
        await fetchTree();
        changed = true;
        whole = true;
      } else {
        state.polls += 1;
        changed = await follow();
      }
      const finished = TERMINAL.has(state.tree.status);
      if (finished && !state.finalRead) {
        state.finalRead = true;
        if (!whole) {
          await fetchTree();
          changed = true;
        }
      }
      if (changed || state.lastText === null) {
        state.lastText = "rendered";
        renderTree(state.tree);
        if (!whole) scheduleTimeline(finished ? 0 : TIMELINE_MS);
      }
      const box = document.getElementById("message");
      if (box.dataset.kind === "error") showMessage("");
      await refreshSteering();
      stamp();
      if (finished) {
        document.getElementById("updated").textContent += " (finished: no longer polling)";
        return;
      }
      state.finalRead = false;
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

  // ------------------------------------------------------------------ waterfall
  // One bar per task on a time axis: queued, running (model calls as ticks), waiting
  // for children, judging. Siblings of one agent under one parent are grouped into one
  // row ("wide_writer x 30, 1.0-1.4 s") unless opened; subtrees collapse; the critical
  // path is marked and stays visible outside its group.
  const GROUP_MIN = 3;
  const wf = { data: null, open: new Set(), closed: new Set(), timer: null, due: 0 };

  function scheduleTimeline(ms) {
    const due = Date.now() + ms;
    if (wf.timer !== null && wf.due <= due) return;
    if (wf.timer !== null) window.clearTimeout(wf.timer);
    wf.due = due;
    wf.timer = window.setTimeout(refreshTimeline, ms);
  }

  async function refreshTimeline() {
    wf.timer = null;
    try {
      const data = await api("GET", "/trees/" + state.rootId + "/timeline");
      for (const t of data.tasks) { // the server sends integer milliseconds
        t.start /= 1000;
        t.end /= 1000;
        for (const seg of t.segments) { seg[1] /= 1000; seg[2] /= 1000; }
        for (const call of t.calls) { call[0] /= 1000; call[1] /= 1000; }
        for (const tool of t.tools || []) { tool[0] /= 1000; tool[1] /= 1000; }
      }
      wf.data = data;
      renderTimeline();
    } catch (error) {
      const summary = document.getElementById("critical-summary");
      if (summary) summary.textContent = "timeline unavailable: " + error.message;
    }
  }

  function span(value) {
    return value < 10 ? value.toFixed(1) : value.toFixed(0);
  }

  function niceStep(total) {
    const steps = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600];
    for (const step of steps) if (total / step <= 10) return step;
    return Math.ceil(total / 10 / 3600) * 3600;
  }

  function pct(value, total) {
    return (100 * Math.max(0, value) / total).toFixed(3) + "%";
  }

  function bar(className, start, end, total, title) {
    const node = el("div", { className: className, title: title });
    node.style.left = pct(start, total);
    node.style.width = pct(Math.max(end - start, total / 2000), total);
    return node;
  }

  function taskRow(t, index, total, hasKids, isOpen) {
    const label = el("div", { className: "wf-label" }, [
      hasKids ? el("button", { type: "button", className: "wf-toggle",
        "aria-label": isOpen ? "collapse" : "expand", text: isOpen ? "\u25be" : "\u25b8",
        onclick: () => { toggle(wf.open, wf.closed, t.id, isOpen); } }) :
        el("span", { className: "wf-toggle-space" }),
      el("span", { className: "status-dot", "data-status": t.status, title: t.status }),
      el("span", { className: "wf-agent", text: t.agent }),
      el("span", { className: "wf-time", text: span(t.end - t.start) + " s" }),
    ]);
    label.style.paddingLeft = (t.depth * 14) + "px";
    const track = el("div", { className: "wf-track" });
    for (const [kind, a, b] of t.segments) {
      track.append(bar("wf-seg seg-" + kind, a, b, total,
        kind + " " + (b - a).toFixed(2) + " s"));
    }
    for (const [a, b, replayed] of t.calls) {
      track.append(replayed
        ? bar("wf-call wf-replayed", a, b, total, "model call replayed from the record (free)")
        : bar("wf-call", a, b, total, "model call " + (b - a).toFixed(2) + " s"));
    }
    for (const [a, b, name, status] of t.tools || []) {
      track.append(bar("wf-tool" + (status === "failed" ? " wf-tool-failed" : ""), a, b, total,
        "tool " + name + " " + (b - a).toFixed(2) + " s (" + status + ")"));
    }
    return el("div", { className: "wf-row" + (t.critical ? " wf-critical" : ""),
      "data-task-id": t.id, "data-index": index, "data-status": t.status }, [label, track]);
  }

  function groupRow(key, agent, members, tasks, total, depth, isOpen) {
    let lo = Infinity;
    let hi = -Infinity;
    let first = Infinity;
    let firstEnd = Infinity;
    let last = -Infinity;
    const statuses = {};
    for (const i of members) {
      const t = tasks[i];
      const d = t.end - t.start;
      lo = Math.min(lo, d);
      hi = Math.max(hi, d);
      first = Math.min(first, t.start);
      firstEnd = Math.min(firstEnd, t.end);
      last = Math.max(last, t.end);
      statuses[t.status] = (statuses[t.status] || 0) + 1;
    }
    const status = Object.keys(statuses).length === 1 ? Object.keys(statuses)[0] : "mixed";
    const text = agent + " x " + members.length + ", " + span(lo) + "-" + span(hi) + " s";
    const label = el("div", { className: "wf-label" }, [
      el("button", { type: "button", className: "wf-toggle",
        "aria-label": isOpen ? "collapse" : "expand", text: isOpen ? "\u25be" : "\u25b8",
        onclick: () => { toggle(wf.open, null, key, isOpen); } }),
      el("span", { className: "status-dot", "data-status": status, title: JSON.stringify(statuses) }),
      el("span", { className: "wf-agent wf-group-name", text: text }),
    ]);
    label.style.paddingLeft = (depth * 14) + "px";
    const track = el("div", { className: "wf-track" }, [
      bar("wf-envelope", first, last, total, members.length + " tasks"),
      bar("wf-spread", firstEnd, last, total, "they finished between these times"),
    ]);
    return el("div", { className: "wf-row wf-group", "data-group": key, "data-count": members.length },
      [label, track]);
  }

  function toggle(openSet, closedSet, key, isOpen) {
    if (isOpen) {
      openSet.delete(key);
      if (closedSet) closedSet.add(key);
    } else {
      openSet.add(key);
      if (closedSet) closedSet.delete(key);
    }
    renderTimeline();
  }

  function renderTimeline() {
    const data = wf.data;
    const box = document.getElementById("waterfall");
    if (!data || !box) return;
    const began = performance.now();
    const tasks = data.tasks;
    const total = Math.max(data.finished ? data.end : data.now, 0.001);
    const kids = tasks.map(() => []);
    const index = new Map(tasks.map((t, i) => [t.id, i]));
    const onPath = new Set(data.critical_path);
    tasks.forEach((t, i) => {
      t.critical = onPath.has(t.id);
      const parent = t.parent_id === null ? undefined : index.get(t.parent_id);
      if (parent !== undefined) kids[parent].push(i);
    });
    const rows = [];
    const isOpen = (i) => {
      const t = tasks[i];
      if (wf.closed.has(t.id)) return false;
      return wf.open.has(t.id) || t.critical || t.depth === 0;
    };
    const walk = (i, depth) => {
      const open = kids[i].length > 0 && isOpen(i);
      rows.push(taskRow(tasks[i], i, total, kids[i].length > 0, open));
      if (!open) return;
      const byAgent = new Map();
      for (const k of kids[i]) {
        const agent = tasks[k].agent;
        if (!byAgent.has(agent)) byAgent.set(agent, []);
        byAgent.get(agent).push(k);
      }
      for (const [agent, members] of byAgent) {
        const key = tasks[i].id + ":" + agent;
        if (members.length < GROUP_MIN) {
          for (const k of members) walk(k, depth + 1);
        } else if (wf.open.has(key)) {
          rows.push(groupRow(key, agent, members, tasks, total, depth + 1, true));
          for (const k of members) walk(k, depth + 1);
        } else {
          for (const k of members) if (tasks[k].critical) walk(k, depth + 1);
          const rest = members.filter((k) => !tasks[k].critical);
          if (rest.length) rows.push(groupRow(key, agent, rest, tasks, total, depth + 1, false));
        }
      }
    };
    walk(0, 0);
    const step = niceStep(total);
    const axis = el("div", { className: "wf-track wf-axis-track" });
    for (let x = 0; x <= total * 0.94; x += step) { // no label cut off at the right edge
      const tick = el("span", { className: "wf-tick", text: (step < 1 ? x.toFixed(2) : x.toFixed(0)) + " s" });
      tick.style.left = pct(x, total);
      axis.append(tick);
    }
    const head = el("div", { className: "wf-row wf-axis" }, [
      el("div", { className: "wf-label", text: tasks.length + " tasks" }), axis]);
    box.replaceChildren(head, ...rows);
    box.dataset.rows = String(rows.length);
    box.dataset.renderMs = (performance.now() - began).toFixed(1);
    const summary = document.getElementById("critical-summary");
    summary.textContent = data.summary;
    summary.dataset.finished = String(data.finished);
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
    state.tree = null; // read it whole again, then follow it
    state.finalRead = false;
    schedule(0);
  }

  // ------------------------------------------------------------------ steering
  // Pause, resume and cancel the tree; answer its questions to a person; approve or
  // reject its held tasks. Read on every poll (GET /trees/{id}/pause, GET /inbox).
  async function refreshSteering() {
    if (!state.rootId) return;
    try {
      const [pause, inbox] = await Promise.all([
        api("GET", "/trees/" + state.rootId + "/pause"),
        api("GET", "/inbox"),
      ]);
      renderSteer(pause);
      renderInbox(inbox.filter((i) => i.root_id === state.rootId && i.kind !== "escalation"));
    } catch (error) {
      showMessage("could not read the steering state: " + error.message, "error");
    }
  }

  function steerButton(label, className, onclick) {
    return el("button", { type: "button", className: "steer " + className, text: label,
      onclick: onclick });
  }

  function renderSteer(pause) {
    const box = document.getElementById("steer");
    const paused = document.getElementById("paused");
    paused.hidden = !pause.paused;
    paused.textContent = pause.paused ? "paused" + (pause.paused_by ? " by " + pause.paused_by : "") : "";
    const finished = state.tree && TERMINAL.has(state.tree.status);
    box.replaceChildren(...(finished ? [] : [
      pause.paused
        ? steerButton("Resume", "resume", () => steer("POST", "/trees/" + state.rootId + "/resume", {}, "resumed"))
        : steerButton("Pause", "pause", () => steer("POST", "/trees/" + state.rootId + "/pause",
          { note: "paused from the web page" }, "paused")),
      steerButton("Cancel tree", "cancel", () => {
        if (window.confirm("Cancel this whole tree? Its open tasks end cancelled.")) {
          steer("POST", "/tasks/" + state.rootId + "/cancel",
            { note: "cancelled from the web page" }, "cancelled");
        }
      }),
    ]));
  }

  // A form from the question's answer_schema: choices as buttons, an object's properties
  // as fields (text, number, checkbox, or a select for an enum), anything else as JSON.
  function answerForm(item) {
    const send = (answer) => steer("POST", "/tasks/" + item.id + "/answer",
      { answer: answer, by: "web page" }, "answered");
    if (item.choices && item.choices.length) {
      return el("div", { className: "answer-form" }, item.choices.map((choice) =>
        el("button", { type: "button", className: "answer choice", "data-choice": JSON.stringify(choice),
          text: typeof choice === "string" ? choice : JSON.stringify(choice),
          onclick: () => send(choice) })));
    }
    const schema = item.answer_schema || {};
    const props = schema.type === "object" && schema.properties ? schema.properties : null;
    const form = el("form", { className: "answer-form" });
    const fields = [];
    if (props) {
      for (const [name, spec] of Object.entries(props)) {
        let input;
        if (Array.isArray(spec.enum)) {
          input = el("select", { name: name }, spec.enum.map((v) =>
            el("option", { value: JSON.stringify(v), text: String(v) })));
        } else if (spec.type === "boolean") {
          input = el("input", { type: "checkbox", name: name });
        } else {
          input = el("input", { type: spec.type === "number" || spec.type === "integer" ? "number" : "text",
            name: name });
        }
        fields.push([name, spec, input]);
        form.append(el("label", {}, [el("span", { text: name }), input]));
      }
    } else {
      const input = el("textarea", { name: "json", rows: 2, placeholder: "the answer as JSON" });
      fields.push(["json", {}, input]);
      form.append(input);
    }
    form.append(el("button", { type: "submit", className: "answer submit", text: "Answer" }));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      try {
        if (!props) return send(JSON.parse(fields[0][2].value));
        const answer = {};
        for (const [name, spec, input] of fields) {
          if (input.tagName === "SELECT") answer[name] = JSON.parse(input.value);
          else if (spec.type === "boolean") answer[name] = input.checked;
          else if (spec.type === "number" || spec.type === "integer") {
            if (input.value !== "") answer[name] = Number(input.value);
          } else if (input.value !== "") answer[name] = input.value;
        }
        return send(answer);
      } catch (error) {
        showMessage("the answer is not valid JSON: " + error.message, "error");
        return null;
      }
    });
    return form;
  }

  function inboxItem(item) {
    const head = el("div", { className: "line" }, [
      el("span", { className: "status", "data-status": item.kind === "approval" ? "awaiting_approval" : "pending",
        text: item.kind }),
      el("span", { className: "question", text: item.question || "" }),
      el("span", { className: "hint", text: "asked by " + (item.asking_agent || "?") + ", " +
        Math.round(item.age_seconds) + " s ago" }),
      el("code", { className: "id", title: item.id, text: item.id.slice(0, 8) }),
    ]);
    let body;
    if (item.kind === "question") {
      body = answerForm(item);
    } else {
      const note = el("input", { type: "text", className: "note", placeholder: "note (needed to reject)" });
      body = el("div", { className: "actions" }, [
        el("button", { type: "button", className: "approve", text: "Approve",
          onclick: () => steer("POST", "/tasks/" + item.id + "/approve",
            { note: note.value || null, by: "web page" }, "approved") }),
        note,
        el("button", { type: "button", className: "reject", text: "Reject",
          onclick: () => steer("POST", "/tasks/" + item.id + "/reject",
            { note: note.value, by: "web page" }, "rejected") }),
      ]);
    }
    return el("li", { className: "inbox-item", "data-task-id": item.id, "data-kind": item.kind },
      [head, body]);
  }

  function renderInbox(items) {
    const section = document.getElementById("inbox");
    section.hidden = items.length === 0;
    const list = document.getElementById("inbox-items");
    const editing = list.contains(document.activeElement);
    if (editing && list.dataset.ids === items.map((i) => i.id).join(",")) return;
    list.dataset.ids = items.map((i) => i.id).join(",");
    list.replaceChildren(...items.map(inboxItem));
  }

  async function steer(method, path, body, what) {
    for (const b of document.querySelectorAll("button.steer, .inbox button")) b.disabled = true;
    try {
      const out = await api(method, path, body);
      showMessage(out.message || what, out.changed === false ? "error" : "ok");
    } catch (error) {
      showMessage("could not do it: " + error.message, "error");
    }
    for (const b of document.querySelectorAll("button.steer, .inbox button")) b.disabled = false;
    state.tree = null; // read it whole again, then follow it
    state.finalRead = false;
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
      followText();
    }
  });
})();
