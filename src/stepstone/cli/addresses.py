"""How a listening command prints where it listens: ``host:port`` and ``http://host:port/...``, an IPv6
literal in brackets (RFC 3986), so the line can be pasted into a browser or curl."""

from __future__ import annotations

import ipaddress

__all__ = ["host_port", "http_url", "one_port_clashes"]


def host_port(host: str, port: int) -> str:
    """``127.0.0.1:8080``, ``[::1]:8080`` (a host given bracketed is not bracketed again)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def http_url(host: str, port: int, path: str = "") -> str:
    """``http://[::1]:8080/ui/`` for ``("::1", 8080, "/ui/")``."""
    return f"http://{host_port(host, port)}{path}"


def one_port_clashes(host: str, other: str) -> bool:
    """Whether two listeners on these hosts cannot both take one port: the same address, or a wildcard
    (``0.0.0.0``, ``::``: every address) on either side. Two different addresses can (``127.0.0.1`` and
    ``10.0.0.5``); names are compared as written, and a clash they hide is found when the second binds."""
    def address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | str:
        try:
            return ipaddress.ip_address(text.strip("[]"))
        except ValueError:
            return text.lower()

    first, second = address(host), address(other)
    wildcard = any(not isinstance(a, str) and a.is_unspecified for a in (first, second))
    return wildcard or first == second or host == ""
