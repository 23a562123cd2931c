"""The outbox and dead letters: relay status and lag, unpublished events, requeue (with a dry run),
and dead-lettered commands. The outbox is shared by every scope, so its endpoints need a role in
every scope (a ``*`` grant); dead-lettered commands are listed per visible scope."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import Field, model_validator

from stepstone.api import operations as ops
from stepstone.api.auth import ALL_SCOPES
from stepstone.api.bodies import Body
from stepstone.api.context import ApiContext, Caller, OutboxAdmin, Writer, context_of, require
from stepstone.api.pagination import DEFAULT_LIMIT, MAX_BIGINT, MAX_LIMIT, decode_id_cursor, encode_cursor
from stepstone.errors import NotFound

__all__ = ["router"]

router = APIRouter(tags=["outbox"])
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]
Cursor = Annotated[str | None, Query(max_length=1000)]
EventId = Annotated[int, Field(ge=1, le=MAX_BIGINT)]


class RequeueRequest(Body):
    ids: list[EventId] = Field(default_factory=list, max_length=10_000, description="Dead events to requeue.")
    all_dead: bool = Field(default=False, description="Every dead-lettered event instead of `ids`.")
    dry_run: bool = Field(default=False, description="Say what would be requeued; change nothing.")

    @model_validator(mode="after")
    def _one_selection(self) -> RequeueRequest:
        if self.ids and self.all_dead:
            raise ValueError("give ids or all_dead, not both")
        return self


def _outbox(ctx: ApiContext) -> OutboxAdmin:
    if ctx.outbox is None:
        raise NotFound("this server has no outbox configured")
    return ctx.outbox


@router.get("/outbox/status", summary="Pending, in-flight, backing-off and dead events, and the lag")
async def outbox_status(request: Request, who: Caller) -> dict[str, Any]:
    require(who, "viewer", ALL_SCOPES)
    outbox = _outbox(context_of(request))
    return await outbox.summary()


@router.get("/outbox/events", summary="Unpublished events oldest first (only dead letters with dead=true)")
async def outbox_events(
    request: Request, who: Caller, dead: bool = False, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT,
) -> dict[str, Any]:
    require(who, "viewer", ALL_SCOPES)
    after = decode_id_cursor(cursor)
    rows = [r.as_dict() for r in await _outbox(context_of(request)).unpublished(dead=dead, limit=limit + 1,
                                                                                    after=after)]
    items = rows[:limit]
    return {"items": items, "next_cursor": encode_cursor(items[-1]["id"]) if len(rows) > limit else None}


@router.post("/outbox/requeue", summary="Put dead-lettered events back to pending; a result per event")
async def outbox_requeue(request: Request, who: Writer, body: RequeueRequest) -> dict[str, Any]:
    require(who, "operator", ALL_SCOPES)
    outbox = _outbox(context_of(request))
    if body.dry_run or body.all_dead:
        dead = [int(r.as_dict()["id"]) for r in await outbox.unpublished(dead=True, limit=100_000)]
        chosen = dead if body.all_dead else [i for i in body.ids if i in set(dead)]
    if body.dry_run:
        wanted = dead if body.all_dead else body.ids
        results = [{"id": i, "result": "would_requeue" if i in set(chosen) else "not_dead"} for i in wanted]
        return {"dry_run": True, "matched": len(chosen), "results": results}
    done = set(await outbox.requeue(body.ids, all_dead=body.all_dead))
    wanted = sorted(done) if body.all_dead else body.ids
    results = [{"id": i, "result": "requeued" if i in done else "not_dead"} for i in wanted]
    return {"dry_run": False, "matched": len(done), "results": results}


@router.get("/dead-letters", tags=["instances"], summary="Dead-lettered commands (their instances FAILED)")
async def dead_letters(
    request: Request, who: Caller, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT,
) -> dict[str, Any]:
    return await ops.dead_letters(context_of(request), who, cursor=cursor, limit=limit)
