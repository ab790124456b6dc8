"""Callback targets are refused or allowed by the address they reach, however the host is spelled."""

import ipaddress
from datetime import UTC, datetime
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, InvalidCallbackInput
from cmb_dagster.callbacks.cli import callbacks
from cmb_dagster.callbacks.hosts import check_url

LOOPBACK_SPELLINGS = [
    "http://0x7f000001/cb",  # hex
    "http://2130706433/cb",  # one 32-bit number
    "http://0177.0.0.1/cb",  # octal part
    "http://127.1/cb",  # shortened
    "http://0x7f.0.1/cb",  # mixed
    "http://localhost./cb",  # fully qualified name
]
PRIVATE_SPELLINGS = ["http://0xa000001/cb", "http://012.0.0.1/cb", "http://0xa9.254.169.254/cb", "http://0/cb"]
PUBLIC_TARGETS = [
    "http://8.8.8.8/cb",
    "http://0x8080808/cb",
    "http://example.com/cb",
    "http://example.com./cb",
    "http://deadbeef.example/cb",
    "http://cafe.be/cb",
]
EMBEDDED_LOOPBACK = [  # IPv6 forms that carry 127.0.0.1: a translator or tunnel reaches it
    "http://[::ffff:127.0.0.1]/cb",  # IPv4-mapped
    "http://[::127.0.0.1]/cb",  # IPv4-compatible
    "http://[::ffff:0:7f00:1]/cb",  # IPv4-translated
    "http://[64:ff9b::7f00:1]/cb",  # NAT64, well-known prefix
    "http://[64:ff9b:1::7f00:1]/cb",  # NAT64, local prefix of 96 bits
    "http://[64:ff9b:1:ff7f:0:1::]/cb",  # NAT64, local prefix of 56 bits
    "http://[2002:7f00:1::]/cb",  # 6to4
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/cb",  # Teredo, client 127.0.0.1
]
EMBEDDED_PRIVATE = [
    "http://[64:ff9b::a00:1]/cb",  # 10.0.0.1
    "http://[2002:a9fe:a9fe::]/cb",  # 169.254.169.254, the metadata service
    "http://[::192.168.0.1]/cb",
    "http://[2001:0:a00:1:0:f7f7:f7f7:f7f7]/cb",  # Teredo through server 10.0.0.1 to client 8.8.8.8
]
EMBEDDED_PUBLIC = [
    "http://[::ffff:8.8.8.8]/cb",
    "http://[64:ff9b::808:808]/cb",
    "http://[2002:808:808::1]/cb",
    "http://[2001:0:808:808:0:f7f7:f7f7:f7f7]/cb",  # Teredo, server and client 8.8.8.8
]
NO_DATABASE = "postgresql://nobody@127.0.0.1:9/never_connected"  # the check refuses before any connection


@pytest.mark.parametrize("url", LOOPBACK_SPELLINGS + PRIVATE_SPELLINGS + EMBEDDED_LOOPBACK + EMBEDDED_PRIVATE)
def test_every_spelling_of_a_closed_address_is_refused_by_default(url):
    with pytest.raises(InvalidCallbackInput, match=r"^cb_url: host '.+' is not allowed \(loopback"):
        check_url(url, CallbackSettings(allowed_hosts=None))


@pytest.mark.parametrize("url", LOOPBACK_SPELLINGS)
def test_a_client_create_refuses_every_spelling_of_loopback(url):
    with (
        CallbackClient(NO_DATABASE, CallbackSettings(allowed_hosts=None), buffered=False) as client,
        pytest.raises(InvalidCallbackInput, match="^cb_url: .* is not allowed"),
    ):
        client.create("o", "g", "k", datetime(2030, 1, 1, tzinfo=UTC), url)


@pytest.mark.parametrize("url", LOOPBACK_SPELLINGS)
def test_the_create_command_refuses_every_spelling_of_loopback(url, monkeypatch):
    monkeypatch.delenv("CMB_CALLBACK_ALLOWED_HOSTS", raising=False)
    result = CliRunner().invoke(
        callbacks, ["create", "o", "g", "k", "--in", "60", "--url", url], env={"CMB_DATABASE_URL": NO_DATABASE}
    )
    assert isinstance(result.exception, InvalidCallbackInput)
    assert str(result.exception).startswith("cb_url: ")


@pytest.mark.parametrize("url", PUBLIC_TARGETS + EMBEDDED_PUBLIC)
def test_public_targets_stay_allowed(url):
    check_url(url, CallbackSettings(allowed_hosts=None))


ONE_ADDRESS_EMBEDDED = [u for u in EMBEDDED_LOOPBACK if "64:ff9b:1:" not in u and "2001:" not in u]


@pytest.mark.parametrize("url", [u for u in LOOPBACK_SPELLINGS if "localhost" not in u] + ONE_ADDRESS_EMBEDDED)
def test_an_opened_address_opens_its_other_spellings(url):
    check_url(url, CallbackSettings(allowed_hosts=["127.0.0.1"]))


def test_an_opened_name_opens_its_fully_qualified_spelling():
    check_url("http://localhost./cb", CallbackSettings(allowed_hosts=["localhost"]))
    check_url("http://localhost/cb", CallbackSettings(allowed_hosts=["localhost."]))
    check_url("http://a.hooks.example.org./cb", CallbackSettings(allowed_hosts=["*.hooks.example.org"]))


def test_opening_one_address_opens_no_other():
    settings = CallbackSettings(allowed_hosts=["127.0.0.1"])
    for url in ["http://127.2/cb", "http://0x7f000002/cb", "http://localhost./cb"]:
        with pytest.raises(InvalidCallbackInput, match="^cb_url: "):
            check_url(url, settings)


@pytest.mark.parametrize("url", EMBEDDED_LOOPBACK + EMBEDDED_PRIVATE)
def test_a_resolved_address_carrying_a_closed_one_is_refused_at_call_time(url):
    address = ipaddress.ip_address(urlsplit(url).hostname)
    assert not CallbackSettings(allowed_hosts=None).address_allowed(address)
    assert not CallbackSettings(allowed_hosts=["*"]).address_allowed(address)
