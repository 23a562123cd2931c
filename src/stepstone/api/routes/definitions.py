"""Definitions: the registered workflow versions of the visible scopes, their plans, the stranded
report, activating a version (the operator role in its scope), and validating and publishing workflow
documents (`stepstone.api.documents`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import Field

from stepstone.api import documents
from stepstone.api import operations as ops
from stepstone.api.auth import Forbidden, Principal
from stepstone.api.bodies import Body
from stepstone.api.context import Caller, Writer, context_of
from stepstone.api.pagination import DEFAULT_LIMIT, MAX_LIMIT
from stepstone.core.limits import MAX_INT4

__all__ = ["router"]

router = APIRouter(prefix="/definitions", tags=["definitions"])


@router.get("", summary="Registered definitions and versions")
async def list_definitions(
    request: Request, who: Caller, cursor: Annotated[str | None, Query(max_length=1000)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    return await ops.definitions(context_of(request), who, cursor=cursor, limit=limit)


@router.get("/stranded", summary="Versions whose instances may still run but that no worker served lately")
async def stranded_definitions(
    request: Request, who: Caller,
    within_seconds: Annotated[float, Query(gt=0, le=365 * 86400, description="How recently served.")] = 300.0,
) -> list[dict[str, Any]]:
    return await ops.stranded(context_of(request), who, within_seconds)


class DocumentRequest(Body):
    document: str = Field(description="The YAML or JSON text of a workflow document (docs/versions.md), at most "
                                      "262,144 bytes of UTF-8.")
    format: Literal["yaml", "json"] | None = Field(
        default=None, description="yaml or json; guessed from the first character when not given.")


_INVALID: dict[int | str, dict[str, Any]] = {422: {
    "description": "Invalid input; an invalid document is `DocumentInvalid` with `problems` (each `path`, `line`, "
                   "`column`, `message`) and the first one's place",
    "content": {"application/problem+json": {}}}}


@router.post("/validate", summary="Check a workflow document (schema, steps, graph; handlers with the catalog)",
             responses=_INVALID)
async def validate_document(request: Request, _who: Caller, body: DocumentRequest) -> dict[str, Any]:
    return documents.validate_document(context_of(request), body.document, body.format)


async def _publisher(who: Writer) -> Principal:
    """Publishing takes the operator role in the document's scope, which only the document names: a caller
    that holds the role in no scope is refused before its body is looked at (403, not the body's 422)."""
    if not any(who.can("operator", scope) for scope in who.grants):
        raise Forbidden(f"{who.actor} needs the operator role in the document's scope to publish it, and holds "
                        "it in no scope", role="operator", scope="")  # (the document's, unread)
    return who


@router.post("/publish", summary="Validate, record and publish a workflow document (the operator role in its scope)",
             responses=_INVALID)
async def publish_document(
    request: Request, who: Annotated[Principal, Depends(_publisher)], body: DocumentRequest,
) -> dict[str, Any]:
    return await documents.publish_document(context_of(request), who, body.document, body.format)


@router.get("/{scope}/{definition_id}/{version}", summary="One version's plan (its steps and transitions)")
async def get_definition(
    request: Request, who: Caller, scope: str, definition_id: str,
    version: Annotated[int, Path(ge=1, le=MAX_INT4)],
) -> dict[str, Any]:
    return await ops.definition_plan(context_of(request), who, scope, definition_id, version)


class ActivateRequest(Body):
    from_default: bool = Field(default=False, description="Follow this version of the default scope (for a "
                                                          "tenant scope), as `stepstone definitions activate "
                                                          "--from-default`.")


@router.post("/{scope}/{definition_id}/{version}/activate",
             summary="Make a version the scope's current one (what starts by id select from now on)")
async def activate_definition(
    request: Request, who: Writer, scope: str, definition_id: str, version: Annotated[int, Path(ge=1, le=MAX_INT4)],
    body: ActivateRequest | None = None,
) -> dict[str, Any]:
    return await ops.activate(context_of(request), who, scope, definition_id, version,
                              from_default=body is not None and body.from_default)
