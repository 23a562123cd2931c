"""What every route is handed: the stores, the workflows, the policy (auth, read-only), and the
FastAPI dependencies that enforce it.

Routes translate HTTP to an operation and back; authorization happens here, before the operation:

- `principal`: 401 unless the request carries valid credentials;
- `writable`: 405 on every state-changing request of a read-only server (before anything else);
- `visible_instance`: the instance's scope, or 404 when it does not exist *or* the principal sees
  none of its scope (never a leak of its existence); `require(principal, role, scope)`: 403.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import Request

from stepstone.api.auth import Authenticate, Forbidden, Principal, ReadOnly, Unauthenticated
from stepstone.api.live import Broadcaster
from stepstone.authoring.documents import Catalog
from stepstone.authoring.workflow import Registry
from stepstone.client import Client
from stepstone.core.limits import Limits
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.errors import InstanceNotFound
from stepstone.store.management_port import ManagementStore
from stepstone.store.port import ClientStore

__all__ = [
    "PRINCIPAL_STATE",
    "ApiContext",
    "Caller",
    "OutboxAdmin",
    "Writer",
    "context_of",
    "principal",
    "require",
    "visible_instance",
    "writable",
    "writer",
]


class Row(Protocol):
    def as_dict(self) -> dict[str, Any]: ...


class OutboxAdmin(Protocol):
    """What the API needs of the outbox (`stepstone.store.outbox.PostgresOutbox` is one)."""

    async def summary(self) -> dict[str, Any]: ...
    async def unpublished(self, *, dead: bool = False, limit: int = 50, after: int = 0) -> Sequence[Row]: ...
    async def requeue(self, ids: Sequence[int] = (), *, all_dead: bool = False) -> list[int]: ...


@dataclass
class ApiContext:
    """The parts of one management app (see `stepstone.api.create_app`)."""

    store: ClientStore
    management: ManagementStore
    authenticate: Authenticate
    """Principal of an API request (bearer token, or the host's hook)."""
    authenticate_ui: Authenticate | None = None
    """Principal of a UI request (also reads the login cookie); default: `authenticate`."""
    outbox: OutboxAdmin | None = None
    registry: Registry = field(default_factory=Registry)
    catalog: Catalog | None = None
    """The handlers and models workflow documents may name (`stepstone serve --catalog`): validate checks a
    document's names against it when given, and publish binds against it (none: a document naming any
    handler or model is refused, docs/api.md)."""
    read_only: bool = False
    limits: Limits = field(default_factory=Limits)
    default_scope: str = DEFAULT_SCOPE
    broadcaster: Broadcaster | None = None
    ui_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """Keys the UI's CSRF values behind a host's authentication (a token sign-in keys them itself);
    give every replica behind one address the same secret."""

    def client(self, actor: str | None) -> Client:
        """A client acting as `actor`: every state change it makes is recorded with that name."""
        client = Client(self.store, self.registry, limits=self.limits, actor=actor)
        client._registry_named = "the server's --app"  # what `stepstone serve` was given, not the caller's
        return client

    async def close(self) -> None:
        if self.broadcaster is not None:
            await self.broadcaster.close()


def context_of(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.stepstone
    return ctx


PRINCIPAL_STATE = "stepstone_principal"
"""Where `api.body_guard` keeps the principal it authenticated before reading the body (looked up once)."""


BEARER = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="An API token: `Authorization: Bearer sst_...` (`stepstone tokens create`).")
"""The OpenAPI security scheme of every route that takes a principal (so /api/v1/docs can send the
token); `principal` reads the request through the app's `authenticate`, not through this."""


async def principal(
    request: Request, _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None,
) -> Principal:
    ctx = context_of(request)
    found = getattr(request.state, PRINCIPAL_STATE, None) or await ctx.authenticate(request)
    if found is None:
        raise Unauthenticated("authentication required: send Authorization: Bearer <token> "
                              "(create one with `stepstone tokens create`)")
    request.state.principal = found
    return found


def writable(request: Request) -> None:
    if context_of(request).read_only:
        raise ReadOnly(f"this server is read-only: {request.method} {request.url.path} is refused")


async def writer(
    request: Request, _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None,
) -> Principal:
    """The principal of a state-changing request: 405 first on a read-only server, then 401."""
    writable(request)
    return await principal(request)


Caller = Annotated[Principal, Depends(principal)]
Writer = Annotated[Principal, Depends(writer)]


def require(who: Principal, role: str, scope: str) -> None:
    if not who.can(role, scope):
        raise Forbidden(f"{who.actor} needs the {role} role in scope {scope!r} for this",
                        role=role, scope=scope)


async def visible_instance(ctx: ApiContext, who: Principal, instance_id: str) -> str:
    """The scope of the instance; InstanceNotFound when it is missing or outside the caller's scopes."""
    scope = await ctx.management.instance_scope(instance_id)
    if scope is None or not who.sees(scope):
        raise InstanceNotFound(instance_id)
    return scope
