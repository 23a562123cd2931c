"""A migration's history entry holds the full new state as a baseline: redacted at the target's sensitive
paths, as the start's baseline is, while the live state keeps the value for the steps still to run."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import pytest
from pydantic import BaseModel

from stepstone.authoring.sensitive import Sensitive
from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.testing import Engine, open_engine

SECRET = "4111-migrated-canary"  # noqa: S105 - the canary value, not a credential


class CardV1(BaseModel):
    card: Annotated[str, Sensitive]
    charged: str = ""


class CardV2(CardV1):
    currency: str


def _card(version: int, state: type[CardV1]) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("mr_card", version=version, state=state)
    wf.wait("hold", signals={"go": "charge"}, start=True)

    @wf.step(next=None)
    async def charge(_ctx: StepContext, s: CardV1) -> None:
        s.charged = s.card[-6:]

    return wf


card_v1, card_v2 = _card(1, CardV1), _card(2, CardV2)


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(card_v1, card_v2)) as e:
        yield e


async def test_the_migrations_baseline_keeps_no_sensitive_value(engine: Engine) -> None:
    iid = await engine.client.start(card_v1, {"card": SECRET})
    await engine.run_until_idle()
    await engine.client.migrate(iid, to=card_v2, state_transform=lambda s: {**s, "currency": "EUR"})
    pool = engine.store.pool  # type: ignore[attr-defined]
    rows = await pool.fetch("SELECT kind, data::text AS data FROM stepstone.history WHERE instance_id = $1",
                            uuid.UUID(iid))
    migrated = [r["data"] for r in rows if r["kind"] == "INSTANCE_MIGRATED"]
    assert len(migrated) == 1 and '"card": "[redacted]"' in migrated[0]
    assert [r["kind"] for r in rows if "canary" in r["data"]] == []
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["card"], info.state["charged"]) == ("COMPLETED", SECRET, "canary")
    await engine.client.replay(iid, "charge")  # from the migration's baseline: the value comes from the live state
    await engine.run_until_idle()
    again = await engine.client.get(iid)
    assert (again.status, again.state["card"], again.state["charged"]) == ("COMPLETED", SECRET, "canary")
