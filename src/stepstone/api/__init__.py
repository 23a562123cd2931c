"""The management HTTP API (and the web UI beside it): `create_app`, `open_app`, principals and roles.

Install with the ``api`` extra (``pip install 'stepstone[api]'``). docs/api.md and docs/ui.md.
"""

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
