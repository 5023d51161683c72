"""Tuning a tree: fork it (re-run it, paying only for what changed) and compare two trees.

- :mod:`runtime.forks.branch`: :func:`fork` checks a fork's overrides and inserts the
  branch's root;
- :mod:`runtime.forks.diff`: :func:`diff_trees` pairs two trees by path of child keys.
"""

from __future__ import annotations

from runtime.forks.branch import fork, known_models, plan_fork
from runtime.forks.diff import diff_lines, diff_trees

__all__ = ["diff_lines", "diff_trees", "fork", "known_models", "plan_fork"]
