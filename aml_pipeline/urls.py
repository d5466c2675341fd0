"""Database URLs fit for messages: the one rule for hiding a password.

A password in the user part (``user:secret@host``) or in a ``password=`` query parameter becomes
``***``; everything else (host, port, database, other parameters such as ``sslmode``) stays, so
a message still says where. Text that is not a URL has any ``://user:secret@`` in it hidden.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

_PASSWORD_IN_TEXT = re.compile(r"(://[^/@:\s]*:)[^@/\s]*@")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (unchanged when it has none)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    if not parts.scheme:
        return redact_text(url)
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo and userinfo.split(":", 1)[1]:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    hidden = [(k, "***" if k == "password" and v else v) for k, v in pairs]
    if netloc == parts.netloc and hidden == pairs:
        return redact_text(url)
    query = urlencode(hidden, quote_via=_quote)
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _quote(value: str, safe: str, encoding: str | None, errors: str | None) -> str:
    # quote, not quote_plus: libpq decodes %20 but takes "+" literally (options=-c%20x%3Dy); "*"
    # literal, so that a hidden password reads as ***.
    return quote(value, safe=safe + "*", encoding=encoding, errors=errors)


def url_secrets(url: str) -> list[str]:
    """Every spelling of the URL's passwords, to scrub from text a driver wrote (e.g. an error)."""
    secrets: list[str] = []
    try:
        parts = urlsplit(url)
    except ValueError:
        return secrets
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    if ":" in userinfo:
        password = userinfo.split(":", 1)[1]
        secrets += [password, unquote(password)]
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "password":
            secrets += [value, quote(value, safe="")]
    return [s for s in dict.fromkeys(secrets) if s]


def redact_text(text: str) -> str:
    """``text`` with any ``scheme://user:password@`` in it reduced to ``scheme://user:***@``."""
    return _PASSWORD_IN_TEXT.sub(r"\1***@", str(text))
