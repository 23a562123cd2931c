"""Creating, listing and revoking API tokens: what `stepstone tokens` runs.

The token itself is returned once, by `create_token`, and never stored: the table keeps its
SHA-256 (`auth.hash_token`), the role, the scope and who made it.
"""

from __future__ import annotations

import uuid

from stepstone.api.auth import ALL_SCOPES, ROLES, hash_token, new_token
from stepstone.core.limits import DEFAULT_LIMITS, PayloadRejected
from stepstone.core.pin import check_scope
from stepstone.errors import InvalidInput, NotFound
from stepstone.store.management_port import ManagementStore, TokenRecord

__all__ = ["create_token", "list_tokens", "revoke_token"]


def _label(what: str, value: str) -> str:
    """A scope, name or group as instance scopes are checked (`Limits.check_label`): no control
    character, no space around it."""
    try:
        return DEFAULT_LIMITS.check_label(what, value)
    except PayloadRejected as exc:
        raise InvalidInput(f"token {exc}", what=what) from None


async def create_token(
    store: ManagementStore, *, role: str, scope: str = ALL_SCOPES, name: str | None = None,
    created_by: str | None = None, groups: tuple[str, ...] = (),
) -> tuple[str, TokenRecord]:
    """A new token granting `role` in `scope` (``*``: every scope): (the token, its record). `groups`
    are the groups its user belongs to: the task inbox offers it the tasks of those candidate groups."""
    if role not in ROLES:
        raise InvalidInput(f"unknown role {role!r}; roles are {', '.join(ROLES)}", what="role")
    if scope != ALL_SCOPES:  # a scope instances can be started in (`check_scope`), or every one
        check_scope(_label("scope", scope))
    groups = tuple(dict.fromkeys(_label("group", g) for g in groups))
    token_id = uuid.uuid4()
    label = _label("name", name) if name else f"{role}-{scope if scope != ALL_SCOPES else 'all'}-{token_id.hex[:8]}"
    token = new_token()
    record = await store.create_token(token_id, label, hash_token(token), role, scope, created_by, groups)
    return token, record


async def list_tokens(store: ManagementStore, *, include_revoked: bool = False) -> list[TokenRecord]:
    return await store.list_tokens(include_revoked=include_revoked)


async def revoke_token(store: ManagementStore, token_id: str) -> TokenRecord:
    record = await store.revoke_token(token_id)
    if record is None:
        raise NotFound(f"no API token {token_id}")
    return record
