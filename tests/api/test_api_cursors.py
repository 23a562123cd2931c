"""Page cursors the API did not make are 422 InvalidInput on every list, never a 500 from a number the
column cannot hold nor a 404 from an id that is not one: each cursor decodes through one helper
(`stepstone.cursors`), which checks each value against what its column holds."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from stepstone.api.pagination import encode_cursor
from tests.api.conftest import Api

V1 = "/api/v1"
AT = "2026-12-06T06:34:49Z"
TASK = "599a8a36-18a9-50d0-97f2-6e6d6eacf962"


def _cursor(*key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode().rstrip("=")


@pytest.mark.parametrize("key", [
    (99_999_999_999, AT, TASK),  # past int4: the priority column's overflow was a 500
    (1e300, AT, TASK),
    (-(2**31) - 1, AT, TASK),
    (True, AT, TASK),
    (50, AT, "not-a-uuid"),  # was 404 TaskNotFound
    (50, "2026-12-06T06:34:49", TASK),  # no timezone: the instance list refuses it, so does this
    (50, "0001-01-01T00:00:00+00:01", TASK),
    (50, 20261206, TASK),
])
async def test_a_task_cursor_the_api_did_not_make_is_invalid_input(api: Api, key: tuple[Any, ...]) -> None:
    admin = await api.token("admin")
    r = await api.http.get(f"{V1}/tasks", headers=admin, params={"mode": "all", "cursor": _cursor(*key)})
    assert (r.status_code, r.json()["error"], r.json()["what"]) == (422, "InvalidInput", "cursor"), r.text


async def test_a_number_past_its_column_in_a_cursor_is_invalid_input(api: Api) -> None:
    iid = await api.start("c")
    admin = await api.token("admin")
    for path, key in ((f"instances/{iid}/history", (2**63 - 1,)),  # history.seq is an integer (int4)
                      (f"instances/{iid}/history", (2**31,)),
                      ("definitions", ("default", "job", 3_000_000_000)),  # definitions.version: int4
                      ("definitions", ("default", "job", -1)),
                      ("definitions", ("default\x00", "job", 1)),
                      ("instances", ("2026-12-06T06:34:49", iid)),
                      ("instances", (AT, "not-a-uuid")),
                      (f"instances/{iid}/commands", (2**63,)),  # commands.id is a bigint: one past it
                      ("dead-letters", (-1,))):
        r = await api.http.get(f"{V1}/{path}", headers=admin, params={"cursor": _cursor(*key)})
        assert (path, r.status_code, r.json()["error"]) == (path, 422, "InvalidInput"), r.text
    for path, key in ((f"instances/{iid}/history", (2**31 - 1,)), (f"instances/{iid}/commands", (2**63 - 1,)),
                      (f"instances/{iid}/outbox", (2**63 - 1,)), ("definitions", ("default", "zzz", 2**31 - 1)),
                      ("instances", (AT, iid))):
        r = await api.http.get(f"{V1}/{path}", headers=admin, params={"cursor": encode_cursor(*key)})
        assert (path, r.status_code, r.json()["items"]) == (path, 200, []), r.text


async def test_task_pages_still_follow_their_cursors(api: Api) -> None:
    admin = await api.token("admin")
    for n in range(3):
        await api.engine.client.start("expense", {"employee": f"e{n}", "amount": 1})
    await api.engine.run_until_idle()
    first = (await api.http.get(f"{V1}/tasks", headers=admin, params={"mode": "all", "limit": 2})).json()
    rest = (await api.http.get(f"{V1}/tasks", headers=admin,
                               params={"mode": "all", "limit": 2, "cursor": first["next_cursor"]})).json()
    assert (len(first["items"]), len(rest["items"]), rest["next_cursor"]) == (2, 1, None)
