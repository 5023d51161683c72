"""Each setting's default is written once: the parts take their section, not a copy of it."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config import Section, Settings, load_settings
from runtime.engine.worker import WorkerConfig
from runtime.fleet.orchestrator import FireConfig
from runtime.schedules.ticker import TickerConfig
from runtime.webhooks import DeliveryConfig

PART_CONFIGS = (WorkerConfig, FireConfig, DeliveryConfig, TickerConfig)


def _setting_keys() -> set[str]:
    keys: set[str] = set()
    for field in Settings.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            keys |= set(field.annotation.model_fields)
    return keys


@pytest.mark.parametrize("config", PART_CONFIGS, ids=lambda c: c.__name__)
def test_no_part_config_repeats_a_settings_default(config: type) -> None:
    """A field named like a setting may only be a run's own limit, unset by default."""
    repeated = [f.name for f in dataclasses.fields(config)
                if f.name in _setting_keys() and f.default is not None]
    assert repeated == []


def test_a_sections_value_is_what_each_part_uses() -> None:
    settings = load_settings(env={
        "ORGCHART_WORKER__LEASE_SECONDS": "7", "ORGCHART_WORKER__SYNC_THREADS": "3",
        "ORGCHART_RETRY__MAX_DELIVERY": "9", "ORGCHART_ORCHESTRATOR__TASK_CAP": "11",
        "ORGCHART_WEBHOOKS__TIMEOUT_SECONDS": "4", "ORGCHART_WEBHOOKS__MAX_ATTEMPTS": "2",
        "ORGCHART_ORCHESTRATOR__WALL_CLOCK_SECONDS": "60",
    })
    worker = WorkerConfig.from_settings(settings, ("echo",))
    assert (worker.worker.lease_seconds, worker.worker.sync_threads,
            worker.retry.max_delivery) == (7, 3, 9)
    assert FireConfig.from_settings(settings).limits.task_cap == 11
    delivery = DeliveryConfig.from_settings(settings)
    assert (delivery.webhooks.max_attempts, delivery.lease_seconds) == (2, 4 + 5.0)
    assert TickerConfig.from_settings(settings, "t").fire_open_seconds == 60 + 300.0


def test_a_part_built_without_settings_gets_the_sections_defaults() -> None:
    assert WorkerConfig(("echo",)).worker == Settings().worker
    assert FireConfig().orchestrator == Settings().orchestrator
    assert DeliveryConfig().webhooks == Settings().webhooks
    assert TickerConfig("t").orchestrator == Settings().orchestrator


def test_a_commands_override_is_validated_by_the_section() -> None:
    settings = Settings()
    assert WorkerConfig.from_settings(settings, ("echo",), lease_seconds=5,
                                      task_cap=3).worker.lease_seconds == 5
    with pytest.raises(ValueError, match="'batch_size': Input should be less than or equal"):
        WorkerConfig.from_settings(settings, ("echo",), batch_size=5000)
    assert settings.worker.override() is settings.worker
    given = {"lease_seconds": 5, "max_delivery": 4, "task_cap": 3}
    assert settings.worker.override_from(given).lease_seconds == 5
    assert given == {"max_delivery": 4, "task_cap": 3}  # taken out: the rest is not its
