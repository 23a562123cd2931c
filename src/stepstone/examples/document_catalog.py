"""The catalog of the document-defined workflows in docs/versions.md (approval, refund, parcel).

A document names handlers by these registered names; every node that runs the document loads the
same catalog (``--catalog stepstone.examples.document_catalog:catalog``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from stepstone.authoring.documents import Catalog
from stepstone.authoring.workflow import StepContext

__all__ = ["ApprovalNote", "catalog"]


class ApprovalNote(BaseModel):
    """The payload of the refund task's approve decision."""

    note: str


catalog = Catalog()
catalog.model("approval_note", ApprovalNote)


@catalog.handler("review")
async def review(ctx: StepContext, state: dict[str, Any]) -> None:
    state["reviewed_by"] = "desk"
    state["key"] = ctx.idempotency_key


@catalog.handler("ship")
def ship(_ctx: StepContext, state: dict[str, Any]) -> None:
    state["shipped"] = True
