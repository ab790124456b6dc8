"""Secrets of database URLs and conninfo strings: mask them for display, scrub them out of any text.

Every place that shows a URL, a conninfo string or a message that may quote one (errors, logs,
tracebacks, run tags) goes through :func:`mask` or :func:`scrub`. libpq secrets are the password of
the user-info part (``postgresql://user:secret@host``) and the ``password`` and ``sslpassword``
parameters (``?password=secret`` or ``password=secret`` in key=value form). Nothing here raises on
malformed input: a URL libpq cannot parse is masked by the same rules, erring on masking too much.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote, unquote_plus

MASK = "***"
SECRET_KEYS = frozenset({"password", "sslpassword"})
_SHORTEST_PIECE = 4

_URL = re.compile(r"^\s*(postgres(?:ql)?(?:\+\w+)?://)(.*)$", re.IGNORECASE | re.DOTALL)
_URL_IN_TEXT = re.compile(r"postgres(?:ql)?(?:\+\w+)?://[^\s'\"<>]*", re.IGNORECASE)
# key=value conninfo: the value is 'quoted' (with \' and \\ escapes) or runs to the next blank
_CONNINFO_SECRET = re.compile(
    r"(?<![\w.])((?:ssl)?password)(\s*=\s*)(?!\*\*\*(?:[\s&'\"]|$))('(?:[^'\\]|\\.)*'?|[^\s&]*)", re.IGNORECASE
)


def is_url(source: str) -> bool:
    """Whether ``source`` is a ``postgresql://`` URL (rather than a key=value conninfo string)."""
    return bool(_URL.match(source))


def mask(source: str) -> str:
    """``source`` (a URL or a conninfo string) with every secret replaced by ``***``."""
    return mask_url(source) if is_url(source) else mask_conninfo(source)


def mask_url(url: str) -> str:
    """A ``postgresql://`` URL with its user-info password and secret parameters replaced by ``***``."""
    match = _URL.match(url)
    if not match:
        return mask_conninfo(url)
    scheme, rest = match.groups()
    userinfo, rest = _split_userinfo(rest)
    shown = scheme
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        shown += f"{user}:{MASK}@" if colon and password else f"{userinfo}@"
    base, question, query = rest.partition("?")
    shown += base
    if question:
        shown += "?" + "&".join(_mask_parameter(part) for part in query.split("&"))
    return _replace_all(shown, _secrets_of_url(url))  # an odd URL read another way hides nothing either


def mask_conninfo(conninfo: str) -> str:
    """A key=value conninfo string (or any text) with ``password=...`` and ``sslpassword=...`` masked."""
    return _CONNINFO_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", conninfo)


def secrets_of(source: str | None) -> set[str]:
    """The secret strings of a URL or conninfo string, as written and as decoded (possibly several readings)."""
    if not source:
        return set()
    found = _secrets_of_url(source) if is_url(source) else set()
    for match in _CONNINFO_SECRET.finditer(source):
        value = match.group(3)
        found.add(value)
        if value.startswith("'"):
            found.add(re.sub(r"\\(.)", r"\1", value[1:].removesuffix("'")))
    try:
        from psycopg.conninfo import conninfo_to_dict

        parsed = conninfo_to_dict(source)
    except Exception:  # noqa: BLE001 - a source libpq cannot read has only the secrets found above
        parsed = {}
    found.update(str(value) for key, value in parsed.items() if key in SECRET_KEYS and value)
    return {secret for secret in found if secret and secret != MASK}


def scrub(text: str, *sources: str | None, secrets: Iterable[str] = ()) -> str:
    """``text`` without the secrets of ``sources`` (URLs or conninfo strings), nor ``secrets``, nor any
    secret of a URL or ``password=`` it quotes itself."""
    for source in sources:
        if source and source in text:
            text = text.replace(source, mask(source))
    hidden: set[str] = {secret for secret in secrets if secret}
    for source in sources:
        hidden |= secrets_of(source)
    text = _replace_all(text, hidden)
    text = _URL_IN_TEXT.sub(lambda m: mask_url(m.group()), text)
    return mask_conninfo(text)


def _replace_all(text: str, secrets: Iterable[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _split_userinfo(rest: str) -> tuple[str | None, str]:
    """``(user-info, the rest)`` of a URL after its scheme; the user-info ends at its last ``@``.

    A password may hold raw ``@``, ``/`` or ``?``: the last ``@`` that is not inside the query wins.
    """
    at = rest.rfind("@")
    while at >= 0:
        question = rest.rfind("?", 0, at)
        if question >= 0 and "=" in rest[question:at]:  # this '@' is in a query value
            at = rest.rfind("@", 0, question)
        else:
            break
    if at < 0:
        return None, rest
    return rest[:at], rest[at + 1 :]


def _mask_parameter(part: str) -> str:
    key, equals, value = part.partition("=")
    if equals and value and unquote_plus(key).strip().lower() in SECRET_KEYS:
        return f"{key}={MASK}"
    return part


def _secrets_of_url(url: str) -> set[str]:
    match = _URL.match(url)
    if not match:
        return set()
    rest = match.group(2)
    found: set[str] = set()
    userinfo, after = _split_userinfo(rest)
    if userinfo is not None:
        password = userinfo.partition(":")[2]
        if password:
            found |= {password, unquote(password)}
            # libpq ends the user-info at the first '@' or '/', so its messages may quote a piece of a
            # password that holds them raw (as a host name): hide such pieces too, unless too short to matter
            found |= {piece for piece in re.split(r"[@/?#:]", password) if len(piece) >= _SHORTEST_PIECE}
    for query in (after.partition("?")[2], rest.partition("?")[2]):
        for part in query.split("&"):
            key, equals, value = part.partition("=")
            if equals and value and unquote_plus(key).strip().lower() in SECRET_KEYS:
                found |= {value, unquote(value), unquote_plus(value)}
    return {secret for secret in found if secret}
