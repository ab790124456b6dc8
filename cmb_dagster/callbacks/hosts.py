"""The host policy: which URLs callbacks may name, and which addresses their calls may connect to.

Public addresses are open; loopback, link-local, private and metadata targets only when ``allowed_hosts`` (or
CMB_CALLBACK_ALLOWED_HOSTS) opens them. Names are judged when an event is created, and the addresses a name
resolves to again when it is called.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from cmb_dagster.callbacks.errors import InvalidCallbackInput
from cmb_dagster.callbacks.launches import DAGSTER_SCHEME, JOB_NAME

if TYPE_CHECKING:
    from cmb_dagster.callbacks.models import CallbackSettings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
ALLOWED_HOSTS_ENV = "CMB_CALLBACK_ALLOWED_HOSTS"
ANY_PUBLIC_HOST = "*"
# Names refused unless listed by name: they point at this machine or at a cloud metadata service.
_LOCAL_NAMES = ("localhost", "metadata.google.internal", "metadata")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")
_NUMERIC_HOST = re.compile(r"[0-9a-fA-FxX.]+")  # what an IPv4 address may look like to the resolver
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # RFC 4291 (deprecated): ::a.b.c.d, but :: and ::1 are IPv6's own
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # RFC 2765 (SIIT): ::ffff:0:a.b.c.d
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052, the well-known prefix
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: a network's own NAT64 prefix within it
_LOCAL_NAT64_LENGTHS = (48, 56, 64, 96)  # the RFC 6052 prefix lengths that fit within it: the network's choice


def normalise_hosts(value: Any) -> tuple[str, ...] | None:
    """``allowed_hosts`` (a list, or one comma-separated text) as they are matched: lower case, without brackets
    or a root dot; ValueError for an entry that is not a host name, '*.domain', address, CIDR range or '*'."""
    if isinstance(value, str):
        value = value.split(",")
    if value is None:
        return None
    hosts = tuple(_without_root_dot(str(h).strip().lower().strip("[]")) for h in value if str(h).strip())
    for host in hosts:
        _check_pattern(host)
    return hosts


def hosts_from_env() -> tuple[str, ...] | None:
    """The ``allowed_hosts`` CMB_CALLBACK_ALLOWED_HOSTS gives, None when it is not set."""
    value = os.environ.get(ALLOWED_HOSTS_ENV, "").strip()
    try:
        return normalise_hosts(value) if value else None
    except ValueError as exc:
        raise InvalidCallbackInput(f"{ALLOWED_HOSTS_ENV}: {exc}") from None


ENDPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}")
"""A name an owner gives an endpoint: up to 128 letters, digits, '_', '.', '-' and '/' (never a URL: no ':')."""


def endpoint_key(value: str) -> str | None:
    """The endpoint ``value`` names: an http(s) URL's endpoint, or ``value`` itself if it is an endpoint name; None
    otherwise."""
    if not isinstance(value, str):
        return None
    if ENDPOINT_NAME.fullmatch(value):
        return value
    return endpoint_of(value)


@functools.lru_cache(maxsize=4096)
def endpoint_of(url: str) -> str | None:
    """The endpoint an http(s) URL calls: ``scheme://host[:port]/path`` (host in lower case, the port only when not
    the scheme's default, no query or fragment); None for any other URL (``dagster://`` has none)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        return None
    host = f"[{host}]" if ":" in host else host
    default = 443 if parts.scheme == "https" else 80
    at = host if port is None or port == default else f"{host}:{port}"
    return f"{parts.scheme}://{at}{parts.path or '/'}"


def check_url(url: str, settings: CallbackSettings, field: str = "cb_url") -> None:
    """Raise InvalidCallbackInput unless ``url`` is an http(s) URL to an allowed host or ``dagster://<job>``."""
    problem = _url_problem(url, settings.allowed_hosts)
    if problem is not None:
        raise InvalidCallbackInput(f"{field}: {problem}")


@functools.lru_cache(maxsize=8192)
def _url_problem(url: str, allowed_hosts: tuple[str, ...] | None) -> str | None:
    """What is wrong with ``url`` (None: nothing); cached, as creates repeat a few URLs many times."""
    if _CONTROL.search(url):
        return "control characters and spaces are not allowed in a URL"
    try:
        url.encode()
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, UnicodeError) as exc:
        return f"{url!r} is not a valid URL ({exc})"
    if parts.scheme == DAGSTER_SCHEME:
        if not JOB_NAME.match(parts.netloc) or parts.path not in ("", "/") or parts.query or parts.fragment:
            return f"{url!r} must be dagster://<job_name>"
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} must be an http(s) URL with a host, or dagster://<job_name>"
    if port == 0:
        return "port 0 is not a port"
    if not host_allowed(parts.hostname, allowed_hosts):
        return (
            f"host {parts.hostname!r} is not allowed (loopback, link-local, private and metadata targets are "
            f"closed unless opened: CallbackSettings(allowed_hosts=...) or {ALLOWED_HOSTS_ENV})"
        )
    return None


@functools.lru_cache(maxsize=4096)
def host_allowed(host: str, allowed_hosts: tuple[str, ...] | None) -> bool:
    """Whether callbacks may name ``host`` (by the name rule; addresses are checked again at call time)."""
    host = _without_root_dot(host.lower().strip("[]"))
    patterns = allowed_hosts if allowed_hosts is not None else (ANY_PUBLIC_HOST,)
    address = _address(host)
    if address is not None:
        judged = carried_ipv4(address) or (address,)  # an entry that opens them opens this spelling too
        listed = all(any(_name_matches(p, host, a) for p in patterns) for a in judged)
        return listed and address_allowed(address, allowed_hosts)
    if host in patterns:
        return True
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        return False  # only by name: '*' does not open them
    return any(_name_matches(p, host, None) for p in patterns)


def address_allowed(address: Address, allowed_hosts: tuple[str, ...] | None) -> bool:
    """Whether a call may connect to ``address``: a public one, or one ``allowed_hosts`` opens explicitly. An IPv6
    address that carries IPv4 ones (:func:`carried_ipv4`) is judged by each of those: a call to it reaches them."""
    return all(_one_address_allowed(a, allowed_hosts) for a in carried_ipv4(address) or (address,))


def allowed_resolutions(infos: list[tuple[Any, ...]], allowed_hosts: tuple[str, ...] | None) -> list[tuple[Any, ...]]:
    """The entries of ``getaddrinfo`` whose address a call may connect to (an IPv6 zone, ``%eth0``, aside)."""
    return [i for i in infos if address_allowed(ipaddress.ip_address(i[4][0].split("%")[0]), allowed_hosts)]


def _one_address_allowed(address: Address, allowed_hosts: tuple[str, ...] | None) -> bool:
    opened = any(_in_range(address, pattern) for pattern in allowed_hosts or ())
    return opened or (address.is_global and not address.is_multicast)


def carried_ipv4(address: Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 ``address`` carries, which a call to it reaches through a translator or a tunnel:
    IPv4-mapped, IPv4-compatible, IPv4-translated, NAT64 (64:ff9b::/96; 64:ff9b:1::/48 read at each prefix length
    a network may use there), 6to4 (2002::/16), Teredo (2001::/32: its server and its client); () for any other.

    The standard library reads the mapped, 6to4 and Teredo forms (``ipv4_mapped``, ``sixtofour``, ``teredo``) but
    not the others, and calls some of them global by their IPv6 range alone (``::127.0.0.1``, ``64:ff9b::7f00:1``)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return ()
    if address.ipv4_mapped is not None:
        return (address.ipv4_mapped,)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return address.teredo
    value = int(address)
    if address in _NAT64 or address in _IPV4_TRANSLATED or (address in _IPV4_COMPATIBLE and value > 1):
        return (ipaddress.IPv4Address(value & 0xFFFFFFFF),)
    if address in _LOCAL_NAT64:
        return tuple(_nat64_ipv4(value, length) for length in _LOCAL_NAT64_LENGTHS)
    return ()


def _nat64_ipv4(value: int, prefix_length: int) -> ipaddress.IPv4Address:
    """The IPv4 address after a NAT64 prefix of ``prefix_length`` bits in the IPv6 address ``value`` (RFC 6052 2.2:
    bits 64 to 71 are zero and carry none of it)."""
    if prefix_length == 96:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    without_bits_64_to_71 = (value >> 64 << 56) | (value & (1 << 56) - 1)  # 120 bits
    return ipaddress.IPv4Address(without_bits_64_to_71 >> (120 - prefix_length - 32) & 0xFFFFFFFF)


def _without_root_dot(host: str) -> str:
    """``host`` without the trailing dots of a fully qualified name: ``localhost.`` is ``localhost``."""
    prefix = "*." if host.startswith("*.") else ""
    return prefix + host[len(prefix) :].rstrip(".")


def _address(host: str) -> Address | None:
    """The address ``host`` spells, None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _NUMERIC_HOST.fullmatch(host):
        return None
    # the resolver reads hex, octal, one-number and shortened IPv4 too ('0x7f000001', '127.1'): calls reach that address
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


@functools.lru_cache(maxsize=1024)
def _network(pattern: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    if pattern == ANY_PUBLIC_HOST or pattern.startswith("*."):
        return None
    try:
        return ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        return None


def _check_pattern(pattern: str) -> None:
    if pattern == ANY_PUBLIC_HOST or _network(pattern) is not None:
        return
    name = pattern.removeprefix("*.")
    if not name or "*" in name or "/" in name or _CONTROL.search(name):
        raise ValueError(f"{pattern!r} is not a host name, '*.domain', address, CIDR range or '*'")


def _name_matches(pattern: str, host: str, address: Address | None) -> bool:
    if pattern in (ANY_PUBLIC_HOST, host):
        return True
    if address is not None:
        return _in_range(address, pattern)
    return pattern.startswith("*.") and host.endswith(pattern[1:])


def _in_range(address: Address, pattern: str) -> bool:
    """Whether ``pattern`` is an address or a CIDR range that holds ``address``."""
    network = _network(pattern)
    return network is not None and address.version == network.version and address in network
