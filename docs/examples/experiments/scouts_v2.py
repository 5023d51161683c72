"""A variant of the seed's trend analyst for docs/experiments.md: a sharper question.

Load it with ``--agents-module docs.examples.experiments.scouts_v2`` from the repository's
root; ``variants.toml`` beside it runs it wherever the seed's ``trend_analyst`` runs.
"""

from __future__ import annotations

from agents.scouts import TrendAnalyst


class TrendAnalystV2(TrendAnalyst):
    """The trend analyst with a narrower question: the three strongest trends only."""

    name = "trend_analyst_v2"
    prompt_name = "trend_analyst"
    default_question = (
        "Which three trends bear most strongly on this goal, which way is each moving, and "
        "what single piece of evidence supports each?"
    )
