"""Workflow documents over HTTP: validate one (any caller), publish one (the operator role in its scope),
as `stepstone definitions validate` and `publish` do.

The handlers a document names are Python code, which the API process has only when it was given the
catalog (`stepstone serve --catalog MODULE:ATTR`, `open_app(catalog=...)`). Validate checks the names
against that catalog when it has one, and the structure alone (schema, steps named, graph) otherwise. Publish
always binds against it, an empty one when none was given: a document that names a handler or model the
server does not have is refused with each such name at its place, so nothing is published that no worker
with the same catalog could load; one that names none (waits, tasks, timers) is published either way.
An invalid document is `DocumentInvalid` (422 problem+json) with every problem of its first failing stage.
"""

from __future__ import annotations

from typing import Any

from stepstone.api.auth import Principal
from stepstone.api.context import ApiContext, require
from stepstone.authoring.documents import Catalog, load_document
from stepstone.ops import definitions as definition_ops

__all__ = ["publish_document", "validate_document"]


def validate_document(ctx: ApiContext, text: str, fmt: str | None) -> dict[str, Any]:
    """What `stepstone definitions validate -o json` prints for a valid document; DocumentInvalid else."""
    wf = load_document(text, ctx.catalog, fmt=fmt)
    return {"valid": True, "workflow": wf.id, "version": wf.version, "scope": wf.scope, "steps": len(wf.plan.steps),
            "plan_hash": wf.plan.plan_hash, "handlers_checked": ctx.catalog is not None}


async def publish_document(ctx: ApiContext, who: Principal, text: str, fmt: str | None) -> dict[str, Any]:
    """Validate the document against the server's catalog, then, with the operator role in the scope it
    names, record and publish it: what `stepstone definitions publish -o json` prints."""
    wf = load_document(text, ctx.catalog or Catalog(), fmt=fmt)
    require(who, "operator", wf.scope)
    done = await definition_ops.publish_loaded(ctx.store.definitions, wf)
    pin = done.pin
    return {"workflow": pin.definition_id, "version": pin.version, "scope": pin.scope, "plan_hash": pin.plan_hash,
            "status": done.status, "recorded": done.recorded}
