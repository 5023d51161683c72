"""Alembic environment: the same URL resolution as the runtime, online migrations only."""

from __future__ import annotations

import logging.config

from alembic import context

from runtime.config import load_settings
from runtime.store.models import Base
from runtime.store.postgres.engines import one_shot_engine
from runtime.store.postgres.urls import resolve_url

config = context.config
if config.config_file_name is not None and config.attributes.get("connection") is None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    return resolve_url(load_settings().database.url)


def run_migrations_online() -> None:
    """Run migrations on the given connection, or on one opened for the resolved URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = one_shot_engine(_url())  # several hosts, keepalives: as the runtime
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("orgchart migrations run online only: set a database URL and run upgrade")
run_migrations_online()
