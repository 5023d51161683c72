"""Configuration: defaults, the file, environment overrides, clear errors."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from runtime.config import ConfigError, load_settings


def test_defaults_match_the_seed(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    s = load_settings(empty, env={})
    assert (s.retry.max_retry, s.retry.max_delivery) == (3, 3)
    assert (s.routing.prompt_threshold, s.routing.pending_threshold) == (100, 5)
    assert (s.models.local, s.models.cloud) == ("llama3.2:latest", "qwen3:14b")
    assert s.cost.local_per_token == Decimal("0.00001")
    assert s.cost.cloud_per_token == Decimal("0.0001")
    assert s.ollama.url == "http://localhost:11434"
    assert s.llm.backend == "auto"
    assert s.worker.lease_seconds == 30


def test_file_values_and_env_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text('[retry]\nmax_retry = 5\n[ollama]\nurl = "http://a:1"\n')
    s = load_settings(cfg, env={"ORGCHART_OLLAMA__URL": "http://b:2",
                                "ORGCHART_POLICIES__MAX_DEPTH": "1",
                                "ORGCHART_AGENTS__MODULES": "a.b, c"})
    assert s.retry.max_retry == 5
    assert s.ollama.url == "http://b:2"
    assert s.policies.max_depth == 1
    assert s.agents.modules == ["a.b", "c"]


def test_orgchart_config_env_names_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "x.toml"
    cfg.write_text("[worker]\nconcurrency = 9\n")
    assert load_settings(env={"ORGCHART_CONFIG": str(cfg)}).worker.concurrency == 9


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text("[retry]\nmax_retires = 5\n")
    with pytest.raises(ConfigError, match=r"retry\.max_retires.*did you mean 'max_retry'"):
        load_settings(cfg, env={})


def test_unknown_section_is_named_with_a_suggestion(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text("[routeing]\nprompt_threshold = 5\n")
    with pytest.raises(ConfigError, match=r"\[routeing\].*did you mean 'routing'"):
        load_settings(cfg, env={})


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"retry\.max_retry"):
        load_settings(env={"ORGCHART_RETRY__MAX_RETRY": "many"})
    with pytest.raises(ConfigError, match=r"llm\.backend"):
        load_settings(env={"ORGCHART_LLM__BACKEND": "gpt"})


def test_unknown_env_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"ORGCHART_OLLAMA__URI.*did you mean 'url'"):
        load_settings(env={"ORGCHART_OLLAMA__URI": "x"})


def test_malformed_toml_and_missing_file_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[retry\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml", env={})


def test_unknown_price_is_none_not_zero() -> None:
    s = load_settings(env={"ORGCHART_COST__CLOUD_PER_TOKEN": ""})
    assert s.cost.price_for("cloud", "qwen3:14b") is None
    assert s.cost.price_for("local", "llama3.2:latest") == Decimal("0.00001")


def test_example_config_at_the_root_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "orgchart.toml"
    assert example.exists()
    load_settings(example, env={})
