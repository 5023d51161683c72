"""Benchmarks: one script per measurement, each printing its figures and returning a dict.

``python -m bench.run_all`` (``make bench``) runs them all and writes
``bench/results/latest.json``. See ``docs/performance.md``.
"""
