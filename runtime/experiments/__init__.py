"""Experiments: datasets of cases run under variants, scored, compared with the baseline."""
