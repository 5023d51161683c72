// The pages' one DOM helper: el(tag, attrs, children) builds an element. Every value from
// the server goes in as text (textContent, setAttribute), never as HTML. Loaded before
// each page's own script (app.js, diff.js, experiment.js).
"use strict";

window.orgchartDom = (function () {
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

  return { el: el };
})();
