"""Issue 15 items 1 and 2: no secret of a URL or conninfo in what is shown, nor in parse errors."""

import logging

import pytest

from cmb_dagster.database import Database
from cmb_dagster.errors import ConfigError
from cmb_dagster.secrets import mask, scrub, secrets_of
from cmb_dagster.settings import Settings

SECRET = "pw4SAFETYtest"


@pytest.mark.parametrize(
    "source,shown",
    [
        (f"postgresql://u:{SECRET}@h:5432/d", "postgresql://u:***@h:5432/d"),
        (f"postgresql://u@h/d?password={SECRET}", "postgresql://u@h/d?password=***"),
        (
            f"postgresql://u@h/d?sslmode=require&sslpassword={SECRET}",
            "postgresql://u@h/d?sslmode=require&sslpassword=***",
        ),
        (
            f"postgres://u:{SECRET}@h/d?PASSWORD={SECRET}x&application_name=a",
            "postgres://u:***@h/d?PASSWORD=***&application_name=a",
        ),
        (f"postgresql://u:{SECRET}@h/d?host=/tmp&password={SECRET}", "postgresql://u:***@h/d?host=/tmp&password=***"),
        (f"postgresql://u:p@{SECRET}/x@h/d", "postgresql://u:***@h/d"),  # raw '@' and '/' in the password
        (f"host=h user=u password={SECRET} dbname=d", "host=h user=u password=*** dbname=d"),
        (f"host=h password='{SECRET} \\' x' sslpassword = {SECRET}", "host=h password=*** sslpassword = ***"),
        ("postgresql://u@h/d", "postgresql://u@h/d"),
        ("postgresql://postgres:@/d?host=/tmp/s", "postgresql://postgres:@/d?host=/tmp/s"),
    ],
)
def test_every_libpq_secret_is_masked(source, shown):
    assert mask(source) == shown


def test_database_display_url_and_status_hide_query_password():
    database = Database(f"postgresql://u@h:1/d?password={SECRET}&sslpassword={SECRET}2")
    assert SECRET not in database.display_url and SECRET not in repr(database)
    assert database.display_url == "postgresql://u@h:1/d?password=***&sslpassword=***"


def test_scrub_hides_the_secrets_of_a_source_in_any_form():
    url = f"postgresql://u:{SECRET}%21@h/d?sslpassword=k%20{SECRET}"
    assert secrets_of(url) >= {f"{SECRET}%21", f"{SECRET}!", f"k {SECRET}"}
    text = f"failed: {url}; token {SECRET}! and k {SECRET}; other postgresql://x:{SECRET}@y/z password={SECRET}"
    cleaned = scrub(text, url)
    assert SECRET not in cleaned and "***" in cleaned


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://u:{SECRET}%zz@h/d",
        f"postgresql://u@h/d?password={SECRET}%zz",
        f"postgresql://u:{SECRET}@h/d?nosuchparameter=1",
    ],
)
def test_a_malformed_url_is_reported_without_its_secret(url):
    with pytest.raises(ConfigError) as raised:
        Database(url).status()
    assert SECRET not in str(raised.value) and "cannot be read" in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        Settings.from_env(database_url=url)
    assert SECRET not in str(raised.value) and "database_url" in str(raised.value)


def test_cli_log_records_and_their_tracebacks_are_scrubbed(monkeypatch, caplog):
    from cmb_dagster.cli import output_scrubber, scrubbed_logs

    monkeypatch.setenv("CMB_DATABASE_URL", f"postgresql://u@h/d?password={SECRET}")
    log = logging.getLogger("cmb_dagster.test")
    with scrubbed_logs(output_scrubber()), caplog.at_level(logging.INFO):
        log.info("connecting with %s", SECRET)
        try:
            raise RuntimeError(f"libpq said {SECRET}")
        except RuntimeError:
            log.exception("failed")
    text = "\n".join(caplog.messages) + caplog.text
    assert SECRET not in text and "***" in text and "RuntimeError" in text
