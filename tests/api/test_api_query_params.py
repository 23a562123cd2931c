"""Repeated query parameters: a list filter takes every value, any other parameter refuses a repeat
(it was reduced to its last value, silently)."""

from __future__ import annotations

from tests.api.conftest import Api

V1 = "/api/v1"


async def test_the_instance_list_takes_every_status_given(api: Api) -> None:
    viewer = await api.token("viewer")
    waiting = await api.start("alpha")
    failed = await api.start("beta", fail=True)
    newest = await api.start("gamma")
    both = [("status", "FAILED"), ("status", "waiting")]
    r = await api.http.get(f"{V1}/instances", headers=viewer, params=both)
    assert r.status_code == 200, r.text
    assert [i["id"] for i in r.json()["items"]] == [newest, failed, waiting]  # only `waiting` ones before
    only = await api.http.get(f"{V1}/instances", headers=viewer, params=[("status", "FAILED")])
    assert [i["id"] for i in only.json()["items"]] == [failed]
    # A page at a time: the statuses' rows merged newest first, each once.
    walked, cursor = [], None
    while True:
        params = [*both, ("limit", "1"), *([("cursor", cursor)] if cursor else [])]
        page = (await api.http.get(f"{V1}/instances", headers=viewer, params=params)).json()
        walked += [i["id"] for i in page["items"]]
        if (cursor := page["next_cursor"]) is None:
            break
    assert walked == [newest, failed, waiting]


async def test_a_parameter_that_takes_one_value_refuses_a_repeat_naming_it(api: Api) -> None:
    viewer = await api.token("viewer")
    iid = await api.start("alpha")
    for path, name, values in [
        ("/instances", "workflow", ["job", "order"]),
        ("/instances", "limit", ["1", "2"]),
        ("/instances/counts", "workflow", ["job", "job"]),
        (f"/instances/{iid}/history", "failed_only", ["true", "false"]),
        ("/tasks", "mode", ["all", "assigned"]),
        ("/tasks/count", "candidate_group", ["a", "b"]),  # a filter of the inbox's shared dependency
        ("/operator/stuck", "older_than_seconds", ["0", "60"]),
    ]:
        r = await api.http.get(f"{V1}{path}", headers=viewer, params=[(name, v) for v in values])
        assert r.status_code == 422, (path, name, r.text)
        body = r.json()
        assert r.headers["content-type"].startswith("application/problem+json")
        assert body["error"] == "InvalidInput" and body["errors"][0]["loc"] == ["query", name], body
        assert name in body["detail"] and "2 times" in body["detail"], body
    # A list parameter still takes several values; one value given once is as before.
    r = await api.http.get(f"{V1}/instances/{iid}/commands", headers=viewer,
                           params=[("state", "PENDING"), ("state", "COMPLETE")])
    assert r.status_code == 200, r.text
    r = await api.http.get(f"{V1}/instances", headers=viewer, params={"workflow": "job", "limit": "1"})
    assert [i["id"] for i in r.json()["items"]] == [iid]


async def test_a_repeated_parameter_without_a_token_is_still_401(api: Api) -> None:
    r = await api.http.get(f"{V1}/instances", params=[("limit", "1"), ("limit", "2")])
    assert r.status_code == 401, r.text


async def test_an_unknown_parameter_is_refused_naming_it(api: Api) -> None:
    """An unknown query parameter was ignored: a typo of a filter (``?stauts=FAILED``) listed everything."""
    viewer = await api.token("viewer")
    iid = await api.start("alpha")
    for path, name in [("/instances", "stauts"), ("/instances/counts", "limit"), ("/tasks/count", "bogus"),
                       ("/operator/stuck", "older_than")]:
        r = await api.http.get(f"{V1}{path}", headers=viewer, params={name: "FAILED"})
        assert r.status_code == 422, (path, name, r.text)
        body = r.json()
        assert body["error"] == "InvalidInput" and body["errors"][0]["loc"] == ["query", name], body
        assert body["errors"][0]["type"] == "unknown"
        assert body["detail"].startswith(f"query.{name}: not a parameter of this route (it takes: "), body
    r = await api.http.get(f"{V1}/instances", headers=viewer, params={"stauts": "FAILED"})
    assert r.json()["detail"] == ("query.stauts: not a parameter of this route (it takes: business_key, cursor, "
                                  "include_archived, limit, scope, status, workflow)")  # as docs/api.md says
    # A route without query parameters says so; the known ones are answered as before.
    r = await api.http.get(f"{V1}/instances/{iid}/positions", headers=viewer, params={"status": "FAILED"})
    assert r.status_code == 422 and "(it takes: none)" in r.json()["detail"], r.text
    r = await api.http.get(f"{V1}/instances", headers=viewer, params={"status": "FAILED", "limit": "1"})
    assert r.status_code == 200, r.text
    # Without a token the answer is still 401, not the 422 that would tell the route's parameters.
    assert (await api.http.get(f"{V1}/instances", params={"stauts": "FAILED"})).status_code == 401
