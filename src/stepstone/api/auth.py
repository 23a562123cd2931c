"""Who is asking, and what they may do: principals, roles per scope, API tokens.

A `Principal` is an actor (recorded on every state-changing request) with one role per scope; the
scope ``*`` stands for every scope. Roles, weakest first: viewer (read), task_worker (read and work
on tasks), operator (steer instances, requeue events), admin (everything). A stronger role includes
the weaker ones.

Two ways to learn the principal of a request, both an `Authenticate` (request -> Principal or None):

- `TokenAuth`: a bearer token made by `stepstone tokens create`, of which only the SHA-256 is stored;
  the UI's login form keeps the same token in an HTTP-only cookie.
- a host application's own hook, when stepstone is mounted behind the host's authentication: any
  async function mapping the host's request (its session user) to a `Principal` (docs/api.md).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from stepstone.errors import StepstoneError
from stepstone.store.management_port import ROLES, ManagementStore, TokenRecord

__all__ = [
    "ALL_SCOPES",
    "ROLES",
    "TOKEN_COOKIE",
    "Authenticate",
    "Forbidden",
    "NotLocal",
    "Principal",
    "ReadOnly",
    "TokenAuth",
    "Unauthenticated",
    "hash_token",
    "local_admin",
    "new_token",
]

ALL_SCOPES = "*"
TOKEN_COOKIE = "stepstone_token"  # noqa: S105 - the cookie's name, not a secret
TOKEN_PREFIX = "sst_"  # noqa: S105 - the prefix every token shows, not a secret
_RANK = {role: n for n, role in enumerate(ROLES)}


class Unauthenticated(StepstoneError):
    """No credentials, or credentials that name no active token (HTTP 401)."""


class Forbidden(StepstoneError):
    """The principal may see the thing but lacks the role for the operation (HTTP 403)."""

    def __init__(self, message: str, *, role: str, scope: str) -> None:
        super().__init__(message)
        self.role = role
        self.scope = scope


class NotLocal(StepstoneError):
    """A ``--no-auth`` server refuses what did not come from its own loopback address: another Host
    (DNS rebinding), or a state change from another site or not in JSON (HTTP 403)."""


class ReadOnly(StepstoneError):
    """The server runs read-only: no request may change anything (HTTP 405)."""


@dataclass(frozen=True)
class Principal:
    """An actor and the role it holds in each scope (``*``: every scope); for human tasks, the user
    name and groups the tasks' assignees and candidates are matched against."""

    actor: str
    grants: Mapping[str, str] = field(default_factory=dict)
    groups: tuple[str, ...] = ()
    user: str | None = None
    """The name human tasks know this principal by (default: `actor`)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.grants.values()) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown role(s) {unknown}; roles are {', '.join(ROLES)}")

    def role_in(self, scope: str) -> str | None:
        """The strongest role this principal holds in `scope` (through ``*`` too), or None."""
        held = [r for s, r in self.grants.items() if s in (scope, ALL_SCOPES)]
        return max(held, key=_RANK.__getitem__) if held else None

    def can(self, role: str, scope: str) -> bool:
        held = self.role_in(scope)
        return held is not None and _RANK[held] >= _RANK[role]

    def sees(self, scope: str) -> bool:
        return self.role_in(scope) is not None

    @property
    def task_user(self) -> str:
        return self.user or self.actor

    @property
    def global_role(self) -> str | None:
        """The role held in every scope (a ``*`` grant), or None."""
        return self.grants.get(ALL_SCOPES)

    def visible_scopes(self) -> Sequence[str] | None:
        """The scopes whose rows this principal may list; None for every scope."""
        return None if ALL_SCOPES in self.grants else sorted(self.grants)

    def home_scope(self, default: str) -> str:
        """The scope a start goes to when the request names none: the only granted one, else `default`."""
        named = [s for s in self.grants if s != ALL_SCOPES]
        return named[0] if len(named) == 1 and ALL_SCOPES not in self.grants else default


Authenticate = Callable[[Request], Awaitable[Principal | None]]
"""Find the principal of a request, or None when it carries no valid credentials."""


def local_admin() -> Principal:
    """The principal of a server started with ``--no-auth`` (loopback only): admin everywhere."""
    return Principal("local", {ALL_SCOPES: "admin"})


def new_token() -> str:
    """A fresh API token: 256 random bits, URL-safe, with a recognisable prefix."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def principal_of(record: TokenRecord) -> Principal:
    """A token acts as ``token:<name>``; human tasks know it by its name (assign a task to ``mia`` and
    a token named ``mia`` works on it)."""
    return Principal(f"token:{record.name}", {record.scope: record.role}, user=record.name, groups=record.groups)


class TokenAuth:
    """Bearer tokens (``Authorization: Bearer sst_...``), or the UI's cookie holding one."""

    def __init__(self, store: ManagementStore, *, cookie: bool = True) -> None:
        self.store = store
        self.cookie = cookie

    async def __call__(self, request: Request) -> Principal | None:
        token = bearer_token(request.headers.get("authorization"))
        if token is None and self.cookie:
            token = request.cookies.get(TOKEN_COOKIE)
        if not token or not token.startswith(TOKEN_PREFIX) or len(token) > 200:
            return None
        record = await self.store.token_by_hash(hash_token(token))
        return None if record is None else principal_of(record)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None
