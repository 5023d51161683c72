"""The model-call benchmark runs end to end at a toy size and returns its figures."""

from __future__ import annotations

import math

from bench import model_calls


def test_model_calls_bench(server_url: str) -> None:
    figures = model_calls.main(calls=5, n_parallel=4, delay=0.01, server=server_url)
    for key in ("call_ms_durable_on", "call_ms_durable_off", "call_ms_replayed",
                "parallel_4_calls_s_max_parallel_1", "parallel_4_calls_s_max_parallel_8"):
        assert isinstance(figures[key], float) and math.isfinite(figures[key]), key
    assert figures["parallel_server_max_in_flight_1"] == 1
    assert 1 <= figures["parallel_server_max_in_flight_8"] <= 4
