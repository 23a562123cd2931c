"""Workflows whose handlers log through the application's own logger (not under "stepstone"), for
`stepstone worker --log-format` tests: ``--app tests.cli_logging_app:registry``."""

from __future__ import annotations

import logging

from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow

log = logging.getLogger("chatty_app")


class Card(BaseModel):
    charged: bool = False


chatty: Workflow[Card] = Workflow("chatty", state=Card)


@chatty.step(start=True, next=None)
def charge(ctx: StepContext, state: Card) -> None:
    log.debug("below the level: never shown %s", ctx.instance_id)
    log.info("charging the card of %s", ctx.instance_id)
    log.warning("the card of %s is slow", ctx.instance_id)
    state.charged = True


doomed: Workflow[Card] = Workflow("doomed", state=Card)


@doomed.step(start=True, next=None, retry=Retry(max_attempts=2, backoff=0.01))
def decline(ctx: StepContext, state: Card) -> None:
    raise RuntimeError("the card was declined")


registry = Registry(chatty, doomed)
