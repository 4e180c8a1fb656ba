"""URLs as they may be shown: a store URL without its credentials.

A Redis URL may carry a user and a password (``redis://user:secret@host:6379/0``,
or ``?username=…&password=…`` in its query, as redis-py reads it). Every message,
log line and API answer that names a store shows ``redact_url(url)`` instead,
so a password never reaches a caller, a log or a terminal.
"""

from __future__ import annotations

import re

REDACTED = "***"
_SECRET_PARAMS = re.compile(r"(?i)([?&;](?:username|user|password)=)[^&;#]*")


def redact_url(url: str) -> str:
    """``url`` with its userinfo (user and password) and any ``username``/``password``
    query value replaced by ``***``: ``redis://user:secret@host:6379/0`` →
    ``redis://***@host:6379/0``. Everything up to the last ``@`` after ``://`` counts as
    userinfo, so a password with an unescaped ``/``, ``?`` or ``@`` is hidden whole; a
    value without ``://`` (``memory``) is returned with only its query redacted."""
    url = _SECRET_PARAMS.sub(lambda m: m.group(1) + REDACTED, url)
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://{REDACTED}{rest[rest.rfind('@'):]}"
