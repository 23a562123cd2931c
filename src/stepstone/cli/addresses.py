"""How a listening command prints where it listens: ``host:port`` and ``http://host:port/...``, an IPv6
literal in brackets (RFC 3986), so the line can be pasted into a browser or curl."""

from __future__ import annotations

__all__ = ["host_port", "http_url"]


def host_port(host: str, port: int) -> str:
    """``127.0.0.1:8080``, ``[::1]:8080`` (a host given bracketed is not bracketed again)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def http_url(host: str, port: int, path: str = "") -> str:
    """``http://[::1]:8080/ui/`` for ``("::1", 8080, "/ui/")``."""
    return f"http://{host_port(host, port)}{path}"
