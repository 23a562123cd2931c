"""The canary: a secret run through every operation never appears in a table (but the live state), a
log line, or what the operations hand out."""

from __future__ import annotations

import json
import logging

import asyncpg
import pytest

from stepstone.authoring.sensitive import sensitive_paths
from stepstone.core.redaction import REDACTED, Redaction
from stepstone.ops import Operations
from stepstone.testing import Engine
from tests.ops import workflows

PIN = "7734-pin-canary"


def test_marked_fields_are_found_nested_and_in_lists() -> None:
    assert sensitive_paths(workflows.Payment) == (("card",), ("holder", "pin"))

    from pydantic import BaseModel  # noqa: PLC0415 - local models for this one test

    class Item(BaseModel):
        token: workflows.Annotated[str, workflows.Sensitive]  # type: ignore[name-defined]

    class Basket(BaseModel):
        items: list[Item] = []
        maybe: Item | None = None

    assert sensitive_paths(Basket) == (("items", "*", "token"), ("maybe", "token"))


def test_patches_and_texts_are_redacted() -> None:
    r = Redaction((("card",), ("holder", "pin")), hook=workflows.mask_tokens)
    ops = [{"op": "replace", "path": "/card", "value": "c-1234"},
           {"op": "add", "path": "/holder", "value": {"name": "Ann", "pin": "9999"}},
           {"op": "replace", "path": "/note", "value": "paid with c-1234 tok_live_x"}]
    out = r.history_data({"patch": ops}, r.secrets({"card": "c-1234", "holder": {"pin": "9999"}}))
    assert out["patch"] == [
        {"op": "replace", "path": "/card", "value": REDACTED},
        {"op": "add", "path": "/holder", "value": {"name": "Ann", "pin": REDACTED}},
        {"op": "replace", "path": "/note", "value": f"paid with {REDACTED} tok_[redacted]_x"},
    ]


async def _all_rows(conn: asyncpg.Connection) -> dict[str, str]:
    """Every row of every table of the schema as text; the live state column left out."""
    out = {}
    for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'stepstone'"):
        table = r["tablename"]
        rows = await conn.fetch(f"SELECT to_jsonb(t) AS j FROM stepstone.{table} t")
        docs = []
        for row in rows:
            doc = row["j"] if isinstance(row["j"], dict) else json.loads(row["j"])
            if table == "instances":
                doc.pop("state", None)
            docs.append(doc)
        out[table] = json.dumps(docs)
    return out


async def test_the_canary_secret_never_leaves_the_live_state(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = workflows.SECRET
    iid = await engine.client.start(workflows.payment, {"order": "o-1", "card": secret,
                                                         "holder": {"name": "Ann", "pin": PIN}})
    await engine.run_until_idle()  # attempt 1 fails with the card and the pin in its message
    await engine.advance(60)
    await engine.run_until_idle()  # attempt 2 changes both: the patch would carry them
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["card"] == secret + "-v2"  # the live state keeps it
    replayed = await ops.cancel([iid])  # ended already: unchanged
    assert replayed.items[0].outcome == "unchanged"
    result = await ops.replay(iid, "charge")
    assert result.state["card"] == REDACTED
    await engine.run_until_idle()
    await engine.advance(60)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["card"] == secret + "-v2-v2"  # the replay ran on the real values, not on "[redacted]"

    tables = await _all_rows(conn)
    for table, text in tables.items():
        assert "canary" not in text, f"a sensitive value is stored in {table}"
        assert "tok_live_" not in text, f"the hook's token is stored in {table}"
    history = tables["history"]
    assert REDACTED in history and "tok_[redacted]_abc" in history
    assert "declined for Ann" in history  # the rest of the message is kept
    shown = json.dumps([(await ops.detail(iid)).as_dict(), (await ops.history(iid)).as_dict(),
                        (await ops.find()).as_dict(), (await ops.stuck()).as_dict()], default=str)
    assert "canary" not in shown and "tok_live_" not in shown
    assert "canary" not in caplog.text
