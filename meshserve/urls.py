"""URLs as they may be shown: a store URL without its credentials.

A Redis URL may carry a user and a password (``redis://user:secret@host:6379/0``,
or ``?username=…&password=…`` in its query, as redis-py reads it). Every message,
log line and API answer that names a store shows ``redact_url(url)`` instead,
so a password never reaches a caller, a log or a terminal.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

REDACTED = "***"
# a query key naming a credential once percent-decoded, as redis-py decodes it:
# username, password, ssl_password, pass%77ord…
_SECRET_KEY = re.compile(r"(?i)user|pass")
# what a store URL redis-py cannot read is shown as: its own message may quote a
# piece of the password (an unescaped "/" makes the rest of it read as the port)
UNREADABLE = ("the URL cannot be read (is the scheme redis://, rediss:// or unix://, the port a number, and a "
              "/ ? # or @ in the password escaped as %2F %3F %23 %40?)")


def _redact_query(url: str) -> str:
    """``url`` with the value of every query key naming a credential as ``***``."""
    base, sep, rest = url.partition("?")
    if not sep:
        return url
    query, hash_, fragment = rest.partition("#")
    parts = []
    for part in re.split(r"([&;])", query):
        key, eq, _ = part.partition("=")
        parts.append(f"{key}={REDACTED}" if eq and _SECRET_KEY.search(unquote(key)) else part)
    return f"{base}?{''.join(parts)}{hash_}{fragment}"


def redact_url(url: str) -> str:
    """``url`` with its userinfo (user and password) and the value of any query key
    naming a credential (``username``, ``password``, ``ssl_password``, also
    percent-encoded) replaced by ``***``: ``redis://user:secret@host:6379/0`` →
    ``redis://***@host:6379/0``. Everything up to the last ``@`` after ``://`` counts as
    userinfo, so a password with an unescaped ``/``, ``?`` or ``@`` is hidden whole (a
    path with an ``@`` is hidden too: never too little). A value without ``://`` (a
    typo such as ``redis:/user:pw@host``) loses everything before its last ``@``;
    ``memory`` is returned as it is."""
    url = _redact_query(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return f"{REDACTED}{url[url.rfind('@'):]}" if "@" in url else url
    if "@" not in rest:
        return url
    return f"{scheme}://{REDACTED}{rest[rest.rfind('@'):]}"
