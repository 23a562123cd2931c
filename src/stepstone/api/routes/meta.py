"""Who am I, and is the server up."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from stepstone.api.context import Caller, context_of

__all__ = ["router"]

router = APIRouter(tags=["meta"])


@router.get("/whoami", summary="The caller's actor name and roles per scope")
async def whoami(request: Request, who: Caller) -> dict[str, Any]:
    return {"actor": who.actor, "grants": dict(who.grants), "read_only": context_of(request).read_only}


@router.get("/health", summary="The server answers and reaches its database")
async def health(request: Request) -> dict[str, Any]:
    ctx = context_of(request)
    await ctx.management.active_token_count()
    return {"status": "ok", "read_only": ctx.read_only}
