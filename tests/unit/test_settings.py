from pathlib import Path

import pytest

from cmb_dagster import migrations
from cmb_dagster.database import Database, server_address
from cmb_dagster.errors import ConfigError
from cmb_dagster.secrets import mask
from cmb_dagster.settings import Settings


def test_defaults_from_an_empty_environment(monkeypatch):
    for var in ("CMB_DATABASE_URL", "CMB_SCHEMA", "CMB_HOME"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings.from_env()
    assert settings.database_url is None
    assert settings.schema_name == "cmb"
    assert settings.home == Path(".cmb").absolute()


def test_environment_is_read(monkeypatch, tmp_path):
    monkeypatch.setenv("CMB_DATABASE_URL", "postgresql://u@h:1/d")
    monkeypatch.setenv("CMB_SCHEMA", "cmb_two")
    monkeypatch.setenv("CMB_HOME", str(tmp_path))
    settings = Settings.from_env()
    assert (settings.database_url, settings.schema_name, settings.home) == ("postgresql://u@h:1/d", "cmb_two", tmp_path)


@pytest.mark.parametrize("field,value", [("schema_name", "Bad-Schema"), ("database_url", "mysql://x")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        Settings.from_env(**{field: value})


def test_password_is_masked():
    assert mask("postgresql://u:s3cret@h:5432/d") == "postgresql://u:***@h:5432/d"
    assert mask("postgresql://u@h/d") == "postgresql://u@h/d"


def test_server_address_names_host_and_port():
    assert server_address("postgresql://u:p@db.example:6543/d") == "db.example:6543"
    assert server_address("postgresql://u@/d?host=/tmp/sock") == "socket /tmp/sock/.s.PGSQL.5432"


def test_migrations_are_numbered_without_gaps():
    versions = [m.version for m in migrations.available()]
    assert versions == list(range(1, len(versions) + 1))


@pytest.mark.parametrize("name", ["public", "information_schema", "pg_x", "pg_catalog", "pg_toast", "pg_temp_1"])
def test_reserved_schema_names_are_refused_with_a_clear_message(monkeypatch, name):
    monkeypatch.setenv("CMB_SCHEMA", name)
    with pytest.raises(ConfigError, match=rf"schema_name: schema name '{name}' is reserved"):
        Settings.from_env()
    with pytest.raises(ConfigError, match="reserved"):
        Database("postgresql://u@h/d", schema=name)


def test_a_dagster_process_never_starts_the_embedded_server(monkeypatch, tmp_path):
    from cmb_dagster.errors import EmbeddedServerError
    from cmb_dagster.resources import CmbResource

    monkeypatch.delenv("CMB_DATABASE_URL", raising=False)
    monkeypatch.setenv("CMB_HOME", str(tmp_path / "home"))
    with pytest.raises(EmbeddedServerError, match=r"is not running: start it with `cmb-dagster db start`"):
        CmbResource().database  # noqa: B018 - the property is what a sensor or an op reads
    assert not (tmp_path / "home" / "postgres").exists()
