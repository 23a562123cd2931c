"""HEAD is answered wherever GET is, and a 405's Allow header lists what the path takes."""

from __future__ import annotations

from tests.api.conftest import Api

V1 = "/api/v1"


async def test_head_answers_like_get_without_a_body(api: Api) -> None:
    """Every 405 advertised `Allow: GET, HEAD`, yet HEAD (`curl -I`) was 405 everywhere."""
    viewer = await api.token("viewer")
    for path, headers in ((f"{V1}/health", {}), (f"{V1}/instances", viewer), (f"{V1}/whoami", viewer)):
        got, head = await api.http.get(path, headers=headers), await api.http.head(path, headers=headers)
        assert (head.status_code, head.headers["content-type"]) == (200, got.headers["content-type"]), path
    assert (await api.http.head(f"{V1}/instances")).status_code == 401  # HEAD asks as GET does
    assert (await api.http.head("/ui/static/stepstone.css")).status_code == 200
    await api.sign_in("viewer")
    head = await api.http.head("/ui/")
    assert (head.status_code, head.headers["content-type"].split(";")[0]) == (200, "text/html")
    head = await api.http.head("/ui/events")  # the live stream: its headers, and no stream
    assert (head.status_code, head.headers["content-type"].split(";")[0], head.content) == (
        200, "text/event-stream", b"")
    schema = (await api.http.get(f"{V1}/openapi.json")).json()  # the twins stay out of the schema
    assert not [p for p, ops in schema["paths"].items() if "head" in ops]


async def test_a_405_allows_every_method_of_its_path(api: Api) -> None:
    """A MethodNotAllowed listed the methods of the path's first route only (GET /instances: not POST)."""
    operator = await api.token("operator")
    r = await api.http.put(f"{V1}/instances", headers=operator, json={})
    assert (r.status_code, r.json()["error"], r.headers["allow"]) == (405, "MethodNotAllowed", "GET, HEAD, POST")
    r = await api.http.get(f"{V1}/instances/x/cancel", headers=operator)
    assert (r.status_code, r.headers["allow"]) == (405, "POST")
    r = await api.http.delete("/ui/")
    assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")


async def test_read_only_allows_only_what_reads(read_only_api: Api) -> None:
    """ReadOnly said `Allow: GET, HEAD` for a path that takes POST alone: it allows nothing there now."""
    admin = await read_only_api.token("admin")
    r = await read_only_api.http.post(f"{V1}/instances", headers=admin, json={})
    assert (r.status_code, r.json()["error"], r.headers["allow"]) == (405, "ReadOnly", "GET, HEAD")
    r = await read_only_api.http.post(f"{V1}/instances/x/cancel", headers=admin, json={})
    assert (r.status_code, r.json()["error"], r.headers["allow"]) == (405, "ReadOnly", "")
