"""Where the server may listen: loopback by default, elsewhere only with authentication.

`check_bind` is the rule `stepstone serve` applies before it opens a socket: a non-loopback address
(``0.0.0.0``, a LAN address, a host name other than localhost) needs token auth and at least one active
token; ``--no-auth`` is for a loopback address alone.
"""

from __future__ import annotations

import ipaddress

from stepstone.errors import ConfigError

__all__ = ["check_bind", "is_loopback"]


def is_loopback(host: str) -> bool:
    if host.lower() in {"localhost", "localhost."}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name may resolve anywhere: treat it as not loopback


def check_bind(host: str, *, auth: bool, active_tokens: int) -> None:
    """ConfigError (one line) when serving on `host` would expose an unauthenticated API."""
    if is_loopback(host):
        return
    if not auth:
        raise ConfigError(f"refusing to serve on {host} without authentication: --no-auth is for a loopback "
                          "address only (e.g. --host 127.0.0.1)")
    if active_tokens == 0:
        raise ConfigError(f"refusing to serve on {host}: no API token exists, so nobody could sign in; "
                          "create one first: stepstone tokens create --role admin")
