"""Bulk actions: retry, cancel or migrate a selection of instances, or every instance a filter matches,
with a dry run and a result per instance (`stepstone.api.bulk_operations`, `stepstone.api.bulk_migration`)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import AfterValidator, Field, model_validator

from stepstone.api.auth import Principal
from stepstone.api.bodies import Body
from stepstone.api.bulk_migration import bulk_migrate
from stepstone.api.bulk_operations import Action, bulk
from stepstone.api.context import Writer, context_of
from stepstone.api.routes.instances import Status
from stepstone.core.limits import MAX_INT4
from stepstone.ops import InstanceFilter
from stepstone.ops.migration import DEFAULT_PATIENCE

__all__ = ["router"]

router = APIRouter(prefix="/bulk", tags=["bulk actions"])


def _no_nul(value: str) -> str:
    """PostgreSQL text cannot hold NUL: refused here (422) rather than failing the statement (500)."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]
Name = Text | None


class Filter(Body):
    """Which instances: every given field must hold. An empty one, or one that only widens
    (`include_archived`), is refused (as `stepstone repair` refuses a bulk action without ids or a filter):
    acting on every instance must not be one typo away."""

    status: list[Status] = Field(default_factory=list, max_length=20)
    workflow: Name = Field(default=None, max_length=500)
    version: int | None = Field(default=None, ge=1, le=MAX_INT4)
    scope: Name = Field(default=None, max_length=500)
    business_key: Name = Field(default=None, max_length=500)
    business_key_contains: Name = Field(default=None, max_length=500)
    since: datetime | None = Field(default=None, description="Created at or after.")
    until: datetime | None = Field(default=None, description="Created before.")
    updated_since: datetime | None = None
    updated_until: datetime | None = None
    include_archived: bool = False

    def as_filter(self) -> InstanceFilter:
        return InstanceFilter(**{**self.model_dump(), "status": tuple(self.status)})


class BulkRequest(Body):
    ids: list[uuid.UUID] | None = Field(default=None, max_length=10_000, description="These instances ...")
    filter: Filter | None = Field(default=None, description="... or every instance this matches (not both).")
    dry_run: bool = Field(default=False, description="Count what would be acted on; change nothing.")

    @model_validator(mode="after")
    def _one_selection(self) -> BulkRequest:
        if (self.ids is None) == (self.filter is None):
            raise ValueError("give ids or a filter (not both)")
        if self.filter is not None and not self.filter.as_filter().narrows:
            raise ValueError("give ids or at least one filter (e.g. \"status\": [\"FAILED\"]); an empty filter "
                             "(or one that only widens, as include_archived) would select every instance")
        return self


class BulkCancelRequest(BulkRequest):
    reason: Text = Field(default="", max_length=10_000)
    compensate: bool = Field(default=False, description="Compensate each one's completed steps first.")


class BulkMigrateRequest(BulkRequest):
    to_version: int = Field(ge=1, le=MAX_INT4, description="The version of each instance's workflow to move it to.")
    step_map: dict[Text, Text] = Field(default_factory=dict, max_length=1000,
                                     description="Old step -> new step, for steps the target renamed.")
    patience_seconds: float = Field(
        default=DEFAULT_PATIENCE, ge=0, le=300,
        description="How long each migration waits for its turn behind the instance's queued commands before "
                    "it is answered refused.")


def _ids(body: BulkRequest) -> list[str] | None:
    return None if body.ids is None else [str(i) for i in body.ids]


async def _bulk(
    request: Request, who: Principal, action: Action, body: BulkRequest, reason: str = "", compensate: bool = False,
) -> dict[str, Any]:
    return await bulk(context_of(request), who, action, ids=_ids(body),
                      where=None if body.filter is None else body.filter.as_filter(), reason=reason,
                      dry_run=body.dry_run, compensate=compensate)


@router.post("/retry", summary="Retry the failed step of each selected instance (a result per instance)")
async def bulk_retry(request: Request, who: Writer, body: BulkRequest) -> dict[str, Any]:
    return await _bulk(request, who, "retry", body)


@router.post("/cancel", summary="Cancel each selected instance (a result per instance)")
async def bulk_cancel(request: Request, who: Writer, body: BulkCancelRequest) -> dict[str, Any]:
    return await _bulk(request, who, "cancel", body, body.reason, body.compensate)


@router.post("/migrate", summary="Move each selected instance to another version of its workflow (a result each)",
             description="A dry run checks each instance against the target and changes nothing. A filter without a "
                         "status matches the instances that may still run; one matching more than 10,000 is refused.")
async def bulk_migrate_instances(request: Request, who: Writer, body: BulkMigrateRequest) -> dict[str, Any]:
    return await bulk_migrate(context_of(request), who, body.to_version, ids=_ids(body),
                              where=None if body.filter is None else body.filter.as_filter(), step_map=body.step_map,
                              dry_run=body.dry_run, patience=body.patience_seconds)
