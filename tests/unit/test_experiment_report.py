"""An experiment's report reads as its table says (issue 45, items 7 and 11).

One rule decides "same" for the table and for the cases listed as regressions: a tree one
token longer than the baseline's did not regress. Token counts print as integers, not as
``4.46e+03``; the legend's ``[interval]`` is text, not rich markup.
"""

from __future__ import annotations

import io
import uuid
from typing import Any

from rich.console import Console

from runtime.cli.experiments import figure, print_report
from runtime.experiments.report import build_report, is_same

TOKENS = {"baseline": [4460, 3120, 5210], "v2": [4461, 3120, 5209]}
DONE = {"baseline": [1, 1, 1], "v2": [1, 0, 1]}


def report() -> dict[str, Any]:
    experiment = {"id": uuid.uuid4(), "name": "e", "status": "finished", "repeat": 1,
                  "variants": [{"name": "baseline"}, {"name": "v2"}]}
    runs = [{"variant": v, "position": p, "repetition": 0, "root_id": uuid.uuid4(),
             "status": "done", "verdict": None, "paid_calls": 3, "replayed_calls": 0,
             "cost_usd": "0.01", "tokens": TOKENS[v][p]}
            for v in TOKENS for p in range(3)]
    scores = [{"scorer": name, "variant": v, "position": p, "value": values[v][p]}
              for name, values in (("tokens", TOKENS), ("done", DONE))
              for v in values for p in range(3)]
    cases = [{"goal": f"goal {p}"} for p in range(3)]
    return build_report(experiment, runs, scores, [], cases)


def test_one_token_more_is_the_same_in_the_table_and_in_the_cases() -> None:
    built = report()
    v2 = built["variants"][1]
    assert v2["vs_baseline"]["tokens"]["direction"] == "same"
    flagged = [(c["scorer"], c["case"], c["kind"]) for c in built["cases"]]
    assert flagged == [("done", 1, "regression")]


def test_the_same_rule_is_relative_to_the_baseline() -> None:
    assert is_same(1, 4460) and is_same(0, 0)
    assert not is_same(1, 1) and not is_same(1, 0) and not is_same(-100, 4460)


def test_figures_print_integers_as_integers() -> None:
    assert figure(4460.0) == "4,460" and figure(4461.5) == "4,462"
    assert figure(0.123456) == "0.123" and figure(None) == "-"
    assert figure(1.0, sign=True) == "+1" and figure(-0.25, sign=True) == "-0.25"


def test_the_printed_report_keeps_brackets_and_prints_no_exponent() -> None:
    buffer = io.StringIO()
    print_report(report(), Console(file=buffer, width=200, color_system=None))
    text = buffer.getvalue()
    assert "e+0" not in text
    assert "4,263" in text  # the baseline's mean tokens: (4460 + 3120 + 5210) / 3
    assert "difference [interval]" in text
    flagged = [line for line in text.splitlines() if line.startswith("regression:")]
    assert len(flagged) == 1
    assert flagged[0].startswith("regression: v2 on 'goal 1' (done 1 -> 0): orgchart diff ")
