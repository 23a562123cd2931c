"""Messages and signal-with-start: publish a message to the open subscriptions of (name, correlation
key), to every one with `correlate_all`; signal the instance of a business key, starting it first.

A message is addressed by name and key, not by instance, so it can reach instances of any scope: it
takes the operator role in every scope (a ``*`` grant). Signal-with-start works in the scope the
request names (the default scope when it names none), so it takes the operator role in that scope.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Request, status
from pydantic import Field

from stepstone.api.auth import ALL_SCOPES
from stepstone.api.bodies import Body
from stepstone.api.context import Writer, context_of, require
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.errors import DefinitionNotFound

__all__ = ["router"]

router = APIRouter(tags=["messages"])


CorrelationKey = Annotated[str, Field(max_length=500)] | bool | int | Annotated[float, Field(allow_inf_nan=False)]


class MessageRequest(Body):
    name: str = Field(max_length=500)
    correlation_key: CorrelationKey = Field(
        description="A number or a boolean is matched as its JSON text (`true`, `42`), as a wait makes its key.")
    payload: Any = None
    message_id: str | None = Field(default=None, max_length=500,
                                   description="Publishing the same id again answers as the first time.")
    ttl: float | None = Field(default=None, ge=0, le=10 * 365 * 86400,
                              description="Seconds to buffer the message when no subscription is open.")
    correlate_all: bool = Field(default=False, description="Deliver to every open subscription, not the oldest.")


class StartOrSignalRequest(Body):
    workflow: str = Field(max_length=500, description="A workflow of the server's --app (its latest version).")
    business_key: str = Field(max_length=500)
    signal: str = Field(max_length=500)
    payload: Any = None
    input: Any = Field(default=None, description="The instance's input, when this call starts it.")
    dedup_key: str | None = Field(default=None, max_length=500)
    scope: str = Field(default=DEFAULT_SCOPE, max_length=500,
                       description="The scope key the business key belongs to, and the new instance's scope.")


@router.post("/messages", summary="Publish a message (delivered, buffered for its ttl, or dropped)")
async def publish_message(request: Request, who: Writer, body: MessageRequest) -> dict[str, Any]:
    require(who, "operator", ALL_SCOPES)
    published = await context_of(request).client(who.actor).publish_message(
        body.name, body.correlation_key, body.payload, message_id=body.message_id, ttl=body.ttl,
        correlate_all=body.correlate_all)
    return asdict(published)


@router.post("/start-or-signal", status_code=status.HTTP_202_ACCEPTED,
             summary="Signal the instance of a business key, starting it first when there is none")
async def start_or_signal(request: Request, who: Writer, body: StartOrSignalRequest) -> dict[str, Any]:
    if not who.sees(body.scope):
        raise DefinitionNotFound(body.workflow)
    require(who, "operator", body.scope)
    done = await context_of(request).client(who.actor).start_or_signal(
        body.workflow, body.business_key, body.signal, body.payload, input=body.input, dedup_key=body.dedup_key,
        scope=body.scope)
    return {**asdict(done), "scope": body.scope}
