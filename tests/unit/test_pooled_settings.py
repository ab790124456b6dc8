"""Settings of a deployment behind a pooler: the direct URL, and the addresses errors name."""

from __future__ import annotations

import pytest

from cmb_dagster.cli import dagster_env, env_lines
from cmb_dagster.database import Database, server_address
from cmb_dagster.errors import ConfigError
from cmb_dagster.settings import Settings


def test_server_address_names_every_host_of_a_multi_host_url() -> None:
    assert server_address("postgresql://u:p@a.example:5433,b.example:5434/d") == "a.example:5433, b.example:5434"
    assert server_address("postgresql://u@a.example,b.example/d") == "a.example:5432, b.example:5432"
    assert server_address("host=a.example,b.example port=6000") == "a.example:6000, b.example:6000"


def test_a_direct_url_needs_the_pooled_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CMB_DATABASE_URL", raising=False)
    monkeypatch.setenv("CMB_DIRECT_DATABASE_URL", "postgresql://u@db.example/d")
    with pytest.raises(ConfigError, match=r"^direct_database_url: CMB_DIRECT_DATABASE_URL is set without"):
        Settings.from_env()


def test_the_direct_url_makes_the_database_url_pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CMB_DATABASE_URL", "postgresql://u@bouncer.example:6432/d")
    monkeypatch.setenv("CMB_DIRECT_DATABASE_URL", "postgresql://u@db.example/d")
    db = Database.from_settings()
    assert db.pooled and db.direct_url == "postgresql://u@db.example/d"
    assert db.connect_kwargs["prepare_threshold"] is None and "options" not in db.connect_kwargs
    assert not Database("postgresql://u@db.example/d").pooled
    assert "prepare_threshold" not in Database("postgresql://u@db.example/d").connect_kwargs


def test_dagster_storage_is_on_the_direct_url_and_env_reads_its_password_from_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CMB_DATABASE_URL", "postgresql://u:pooled-secret@bouncer.example:6432/d")
    monkeypatch.setenv("CMB_DIRECT_DATABASE_URL", "postgresql://u:direct-secret@db.example/d")
    monkeypatch.delenv("CMB_DAGSTER_STORAGE_URL", raising=False)
    settings = Settings.from_env()
    values = dagster_env(settings, Database.from_settings(settings))
    assert values["CMB_DAGSTER_STORAGE_URL"] == "postgresql+psycopg2://u:direct-secret@db.example/d"
    lines = env_lines(values, settings, show_secrets=False)
    assert 'export CMB_DAGSTER_STORAGE_URL="postgresql+psycopg2://${CMB_DIRECT_DATABASE_URL#*://}"' in lines
    assert not any("direct-secret" in line or "pooled-secret" in line for line in lines)
