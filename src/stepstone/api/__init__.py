"""The management HTTP API (and the web UI beside it): `create_app`, `open_app`, principals and roles.

Install with the ``api`` extra (``pip install 'stepstone[api]'``). docs/api.md and docs/ui.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._lazy_exports import lazy_exports

if TYPE_CHECKING:
    from stepstone.api.app import API_PREFIX, ROUTERS, create_app
    from stepstone.api.auth import ALL_SCOPES, ROLES, Authenticate, Principal, TokenAuth
    from stepstone.api.context import ApiContext
    from stepstone.api.hosting import NO_AUTH, context_on, open_app

__all__ = [
    "ALL_SCOPES",
    "API_PREFIX",
    "NO_AUTH",
    "ROLES",
    "ROUTERS",
    "ApiContext",
    "Authenticate",
    "Principal",
    "TokenAuth",
    "context_on",
    "create_app",
    "open_app",
]

# The public names are imported when first used (PEP 562), not with the package: `stepstone tokens`
# imports stepstone.api.tokens, and with it this package, but needs neither FastAPI nor the app's routes
# and models (0.3 s of CPU of each `stepstone tokens ...`, more than the rest of the command).
_HOMES = {
    "API_PREFIX": "stepstone.api.app",
    "ROUTERS": "stepstone.api.app",
    "create_app": "stepstone.api.app",
    "ALL_SCOPES": "stepstone.api.auth",
    "ROLES": "stepstone.api.auth",
    "Authenticate": "stepstone.api.auth",
    "Principal": "stepstone.api.auth",
    "TokenAuth": "stepstone.api.auth",
    "ApiContext": "stepstone.api.context",
    "NO_AUTH": "stepstone.api.hosting",
    "context_on": "stepstone.api.hosting",
    "open_app": "stepstone.api.hosting",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES)
