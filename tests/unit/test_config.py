"""Configuration: defaults, the file, environment overrides, clear errors."""

from __future__ import annotations

import json
import os
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from runtime.config import ConfigError, load_settings
from runtime.llm.loop import token_rates


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
    cfg.write_text("[worker]\nsync_threads = 9\n")
    assert load_settings(env={"ORGCHART_CONFIG": str(cfg)}).worker.sync_threads == 9


def test_the_retired_concurrency_key_names_its_replacement(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text("[worker]\nconcurrency = 9\n")
    with pytest.raises(ConfigError, match=r"'worker\.concurrency' was retired: use "
                                          r"'worker\.sync_threads'"):
        load_settings(cfg, env={})
    with pytest.raises(ConfigError, match=r"ORGCHART_WORKER__CONCURRENCY: 'worker\."
                                          r"concurrency' was retired: use 'worker\.sync_"):
        load_settings(env={"ORGCHART_WORKER__CONCURRENCY": "4"})


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


def test_a_bad_env_value_is_blamed_on_the_variable_not_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text('[retry]\nmax_retry = 5\n')
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, env={"ORGCHART_LLM__BACKEND": "olama"})
    assert str(info.value).startswith(
        "environment variable ORGCHART_LLM__BACKEND: bad value for 'llm.backend'")
    assert str(cfg) not in str(info.value)
    cfg.write_text('[llm]\nbackend = "olama"\n')
    with pytest.raises(ConfigError, match=f"^{re.escape(str(cfg))}: bad value for 'llm.backend'"):
        load_settings(cfg, env={})


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


def test_each_value_says_where_it_came_from(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text('[retry]\nmax_retry = 5\n[ollama]\nurl = "http://a:1"\n')
    s = load_settings(cfg, env={"ORGCHART_OLLAMA__URL": "http://b:2",
                                "DATABASE_URL": "postgresql://u:secret@db/x"})
    assert s.origin("retry", "max_retry") == str(cfg)
    assert s.origin("ollama", "url") == "ORGCHART_OLLAMA__URL"
    assert s.origin("database", "url") == "DATABASE_URL"
    assert s.origin("worker", "lease_seconds") == "default"
    explained = {(section, key): (value, origin) for section, key, value, origin in s.explain()}
    assert explained[("retry", "max_retry")] == (5, str(cfg))
    assert explained[("cost", "local_per_token")] == ("0.00001", "default")


def _run_config(*args: str, env: dict[str, str]) -> Any:
    from typer.testing import CliRunner

    from runtime.cli.app import app

    return CliRunner().invoke(app, ["config", *args], env=env)


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("ORGCHART_") or k == "DATABASE_URL"]:
        monkeypatch.delenv(key)


def test_orgchart_config_json_and_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text("[worker]\nsync_threads = 9\n")
    env = {"ORGCHART_CONFIG": str(cfg), "ORGCHART_LLM__BACKEND": "offline",
           "ORGCHART_DATABASE_URL": "postgresql://u:secret@db.example/x", "COLUMNS": "200"}
    as_json = _run_config("--json", env=env)
    assert as_json.exit_code == 0, as_json.output
    values = json.loads(as_json.stdout)
    assert values["worker"]["sync_threads"] == 9
    assert values["llm"]["backend"] == "offline"
    assert "secret" not in as_json.stdout and "db.example" in values["database"]["url"]
    table = _run_config(env=env)
    assert table.exit_code == 0, table.output
    line = {row.split()[1]: row for row in table.stdout.splitlines() if row.count("│") >= 3}
    assert str(cfg.name) in line["worker.sync_threads"]
    assert "ORGCHART_LLM__BACKEND" in line["llm.backend"]
    assert "default" in line["retry.max_retry"]


def test_orgchart_config_names_the_bad_key(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    result = _run_config(env={"ORGCHART_WORKER__SYNC_THREAD": "3"})
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: environment variable ORGCHART_WORKER__SYNC_THREAD: unknown key "
        "'worker.sync_thread'; did you mean 'sync_threads'?"]


def test_the_retired_concurrency_option_names_its_replacement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from runtime.cli.app import app

    _clean_env(monkeypatch)
    result = CliRunner().invoke(app, ["worker", "--concurrency", "4"], env={})
    assert result.exit_code == 2
    assert "--concurrency was retired: use --sync-threads" in result.stderr


def _keys_named_in(toml_text: str) -> set[str]:
    """``section.key`` for every key the file sets or shows commented out."""
    named: set[str] = set()
    section = ""
    for line in toml_text.splitlines():
        header = re.match(r"^\[([a-z_]+)\]", line)
        if header:
            section = header.group(1)
            continue
        key = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if key and section:
            named.add(f"{section}.{key.group(1)}")
    return named


def test_the_example_config_names_every_key_orgchart_config_prints(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    example = Path(__file__).resolve().parents[2] / "orgchart.toml"
    result = _run_config("--json", env={"ORGCHART_CONFIG": str(example)})
    assert result.exit_code == 0, result.output
    printed = {f"{section}.{key}" for section, body in json.loads(result.stdout).items()
               for key in body}
    assert printed - _keys_named_in(example.read_text(encoding="utf-8")) == set()


@pytest.mark.parametrize(("text", "named"), [
    ("[tenants.acme]\nwieght = 3\n", "'tenants.acme.wieght'; did you mean 'weight'?"),
    ("[tenants.acme]\nweight = 0\n", "'tenants.acme.weight'"),
    ("[tenants.acme]\nmax_in_flight = -1\n", "'tenants.acme.max_in_flight'"),
    ("[tenants.acme]\ntokens_per_minute = 0\n", "'tenants.acme.tokens_per_minute'"),
    ("[tenants.acme]\ntokens_per_minute = -5\n", "'tenants.acme.tokens_per_minute'"),
    ('[tenants.acme]\ntokens_per_minute = "fast"\n', "'tenants.acme.tokens_per_minute'"),
    ("[tenants.acme]\ntokens_per_minut = 5\n", "did you mean 'tokens_per_minute'?"),
    ("[tenants]\nacme = 3\n", "'tenants.acme' must be a table"),
    ('[tenants."a b"]\nweight = 1\n', "bad tenant name 'tenants.a b'"),
    ("[scheduler]\nmax_wait_seconds = 0\n", "'scheduler.max_wait_seconds'"),
])
def test_a_bad_tenant_or_scheduler_table_names_the_key(tmp_path: Path, text: str,
                                                       named: str) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, env={})
    assert named in str(err.value)


def test_tenant_tables_are_read_with_their_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text("[tenants.acme]\nweight = 3\nmax_in_flight = 10\n[tenants.beta]\n")
    s = load_settings(cfg, env={})
    assert s.tenants["acme"].weight == 3 and s.tenants["acme"].max_in_flight == 10
    assert s.tenants["beta"].max_in_flight is None and s.tenant_weight("beta") == 1.0
    assert s.tenant_weight("nobody") == 1.0
    assert token_rates(s) == {}


def test_tokens_per_minute_is_read_per_tenant(tmp_path: Path) -> None:
    cfg = tmp_path / "orgchart.toml"
    cfg.write_text("[tenants.acme]\ntokens_per_minute = 6000\n[tenants.beta]\nweight = 2\n")
    s = load_settings(cfg, env={})
    assert s.tenants["acme"].tokens_per_minute == 6000
    assert token_rates(s) == {"acme": 6000}


def test_env_tables_are_json_and_lists_json_or_commas(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    s = load_settings(empty, env={"ORGCHART_COST__PRICES": '{"m": "0.5"}',
                           "ORGCHART_POLICIES__DISABLED": '["a", "b"]',
                           "ORGCHART_AGENTS__MODULES": "x.y,z",
                           "ORGCHART_SOURCE": "ignored: not ORGCHART_<SECTION>__<KEY>"})
    assert s.cost.prices == {"m": Decimal("0.5")}
    assert s.policies.disabled == ["a", "b"]
    assert s.agents.modules == ["x.y", "z"]
    assert s.source == str(empty)
    assert s.origin("cost", "prices") == "ORGCHART_COST__PRICES"
    with pytest.raises(ConfigError, match=r"environment variable ORGCHART_COST__PRICES: "
                                          r"bad value for 'cost\.prices'"):
        load_settings(empty, env={"ORGCHART_COST__PRICES": "m=0.5"})
