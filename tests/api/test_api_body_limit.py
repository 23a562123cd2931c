"""A request body is bounded (413 BodyTooLarge past `body_limit`, before it is read whole) and a request
to the API is authenticated before its body is read or parsed (docs/api.md, Request bodies)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from stepstone.api.body_guard import body_limit
from tests.api.conftest import Api

V1 = "/api/v1"
JSON = {"content-type": "application/json"}


def _chunked(total: int, counter: list[int]) -> AsyncIterator[bytes]:
    """`total` bytes of a JSON string sent without a Content-Length; `counter` counts what was pulled."""
    async def chunks() -> AsyncIterator[bytes]:
        sent = 0
        yield b'{"workflow": "job", "input": {"name": "'
        while sent < total:
            counter[0] += 1
            sent += 64 * 1024
            yield b"x" * (64 * 1024)
        yield b'"}}'
    return chunks()


async def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(api: Api) -> None:
    limit = body_limit(api.ctx.limits)
    assert limit == 4 * 256 * 1024
    operator = await api.token("operator")
    big = json.dumps({"workflow": "job", "input": {"name": "x" * limit}})
    for headers in ({}, operator):
        r = await api.http.post(f"{V1}/instances", headers={**headers, **JSON}, content=big)
        assert r.status_code == 413, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert (r.json()["error"], r.json()["limit"]) == ("BodyTooLarge", limit)
    pulled = [0]
    r = await api.http.post(f"{V1}/instances", headers={**operator, **JSON}, content=_chunked(10 * limit, pulled))
    assert (r.status_code, r.json()["error"]) == (413, "BodyTooLarge")
    assert pulled[0] <= limit // (64 * 1024) + 1  # it stopped reading at the limit, not at the end
    r = await api.http.post("/ui/login", content=b"token=" + b"x" * limit,
                            headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 413  # the UI's forms too
    r = await api.http.post(f"{V1}/instances", headers=operator, json={"workflow": "job", "input": {
        "name": "x" * (api.ctx.limits.max_payload_bytes - 100)}})
    assert r.status_code == 201, r.text  # a payload at its own limit fits


async def test_a_request_without_a_token_is_refused_before_its_body_is_read_or_parsed(api: Api) -> None:
    pulled = [0]
    r = await api.http.post(f"{V1}/instances", headers=JSON, content=_chunked(10 * api.ctx.limits.max_payload_bytes,
                                                                             pulled))
    assert (r.status_code, r.json()["error"]) == (401, "Unauthenticated")
    assert pulled[0] == 0
    for body in (b"{not json", b"\xff\xfe", b"[" * 100_000):  # parsed, each would be a 422 or a 400
        r = await api.http.post(f"{V1}/bulk/cancel", headers={**JSON, "Authorization": "Bearer sst_nope"},
                                content=body)
        assert (r.status_code, r.json()["error"]) == (401, "Unauthenticated"), body[:10]
        assert r.headers["www-authenticate"].startswith("Bearer")
    operator = await api.token("operator")
    r = await api.http.post(f"{V1}/bulk/cancel", headers={**JSON, **operator}, content=b"{not json")
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput")
