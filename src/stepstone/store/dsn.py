"""Database URLs for messages: secrets masked, host and port named, malformed ones told apart.

Everything here goes through a URL parser, never a pattern over the whole text, so a password with a
raw ``@`` or ``:`` in it and secrets passed as query parameters (``?password=``) are masked too.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

__all__ = [
    "MASK", "SCHEMES", "endpoint", "malformed_reason", "redact_url", "same_database", "secrets_in", "without_password",
]

MASK = "***"
SCHEMES = ("postgresql", "postgres")
_SECRET_KEY = re.compile(r"pass|secret|token|key", re.IGNORECASE)  # password, passfile, sslpassword, sslkey
_KEYWORD_SECRET = re.compile(
    r"""(\b[a-z_]*(?:pass|secret|token|key)[a-z_]*\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)""", re.IGNORECASE
)


def _split_netloc(netloc: str) -> tuple[str | None, str | None, str]:
    """(user, password, host:port) of a netloc; the last ``@`` ends the userinfo, as libpq reads it."""
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, colon, password = userinfo.partition(":")
    return user, (password if colon else None), hostport


def _mask_query(query: str) -> str:
    # A stray second "?" is split on too, so "?host=/x?password=..." cannot hide a password.
    parts = []
    for item in re.split(r"([&?])", query):
        key, eq, _value = item.partition("=")
        parts.append(f"{key}={MASK}" if eq and _SECRET_KEY.search(unquote(key)) else item)
    return "".join(parts)


def redact_url(url: str) -> str:
    """The URL as written, with its password and every secret query parameter replaced by ``***``.

    Only the secrets are replaced in the text: re-assembling the parsed parts would rewrite what the user
    typed (``sqlite:///x.db`` came back as ``sqlite:/x.db``, a trailing ``?`` was dropped)."""
    if "://" not in url:  # a keyword/value string (host=... password=...)
        return _KEYWORD_SECRET.sub(lambda m: m.group(1) + MASK, url)
    try:
        urlsplit(url)
    except ValueError:  # e.g. an unbalanced [ in the host: keep nothing after the scheme's user
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{MASK}" if rest else url
    # The same split urlsplit makes: the netloc runs to the first / ? or #, the query from ? to #.
    scheme, _, rest = url.partition("://")
    netloc_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:netloc_end], rest[netloc_end:]
    user, password, hostport = _split_netloc(netloc)
    if password is not None:
        netloc = f"{user}:{MASK}@{hostport}"
    before_fragment, hash_, fragment = tail.partition("#")
    path, question, query = before_fragment.partition("?")
    return f"{scheme}://{netloc}{path}{question}{_mask_query(query)}{hash_}{fragment}"


def secrets_in(url: str) -> list[str]:
    """Every secret value the URL holds, raw and percent-decoded, longest first (to scrub messages)."""
    found: set[str] = set()
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    _user, password, _hostport = _split_netloc(parts.netloc)
    if password:
        found |= {password, unquote(password)}
    for item in re.split(r"[&?]", parts.query):
        key, eq, value = item.partition("=")
        if eq and value and _SECRET_KEY.search(unquote(key)):
            found |= {value, unquote(value)}
    for match in _KEYWORD_SECRET.finditer(url if "://" not in url else ""):
        found.add(match.group(2).strip("'"))
    return sorted((s for s in found if s), key=len, reverse=True)


def malformed_reason(url: str) -> str | None:
    """Why ``url`` is not a PostgreSQL URL stepstone can use, or None when it parses."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # parsed lazily: a port that is not a number raises here
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in SCHEMES:
        return "expected postgresql://user@host:port/dbname"
    if parts.netloc.count("@") > 1:  # the driver ends the userinfo at the first @, so the host would be wrong
        return "more than one '@' before the host: write an '@' in the user name or password as %40"
    return None


def endpoint(url: str) -> tuple[str, int | None]:
    """(host, port) named by a URL for messages; a socket directory counts as the host."""
    try:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        host = parts.hostname or query.get("host") or "localhost"
        port = parts.port or int(query.get("port") or "5432")
    except ValueError:
        return "?", None
    return host, port


def same_database(a: str, b: str) -> bool:
    """Whether two URLs name the same database: host, port and database name (the user and the options
    may differ). A keyword/value string equals only itself."""
    if "://" not in a or "://" not in b:
        return a == b

    def name(url: str) -> str:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        return unquote(parts.path.lstrip("/")) or query.get("dbname") or unquote(parts.username or "")

    try:
        return endpoint(a) == endpoint(b) and name(a) == name(b)
    except ValueError:
        return a == b


def without_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password), so a child process gets the password in
    PGPASSWORD and only the rest on its command line (which any local user can read with `ps`)."""
    parts = urlsplit(url)
    user, password, hostport = _split_netloc(parts.netloc)
    netloc = parts.netloc if password is None else f"{user}@{hostport}"
    kept = []
    for item in parts.query.split("&") if parts.query else []:
        key, eq, value = item.partition("=")
        if eq and unquote(key) == "password":
            password = value
        else:
            kept.append(item)
    bare = urlunsplit((parts.scheme, netloc, parts.path, "&".join(kept), parts.fragment))
    return bare, None if password is None else unquote(password)
