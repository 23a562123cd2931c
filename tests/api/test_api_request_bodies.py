"""Request bodies: a field the API does not know is refused (422 naming it), never silently dropped, and a
bulk action with an empty filter is refused as the CLI refuses it."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import Api

V1 = "/api/v1"


def _body_schemas(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every POST and PUT body's schema (its components resolved), by "METHOD path"."""
    components = openapi["components"]["schemas"]
    found = {}
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if method in ("post", "put") and content:
                schema = content["schema"]
                refs = [schema, *schema.get("anyOf", [])]
                [ref] = [s["$ref"] for s in refs if "$ref" in s]
                found[f"{method.upper()} {path}"] = components[ref.rsplit("/", 1)[1]]
    return found


async def test_every_request_body_refuses_fields_it_does_not_know(api: Api) -> None:
    openapi = (await api.http.get(f"{V1}/openapi.json")).json()
    bodies = _body_schemas(openapi)
    assert len(bodies) >= 15, sorted(bodies)
    lax = sorted(where for where, schema in bodies.items() if schema.get("additionalProperties") is not False)
    assert lax == []
    assert openapi["components"]["schemas"]["Filter"].get("additionalProperties") is False


async def test_a_misspelled_field_of_a_bulk_cancel_is_refused_and_cancels_nothing(api: Api) -> None:
    failed = await api.start("f", fail=True)
    operator = await api.token("operator")
    for body, field in (({"filter": {"status": ["FAILED"]}, "dry-run": True}, "dry-run"),
                        ({"filter": {"stauts": ["FAILED"]}, "dry_run": True}, "filter.stauts")):
        r = await api.http.post(f"{V1}/bulk/cancel", headers=operator, json=body)
        assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
        assert field in r.json()["detail"], r.text
    r = await api.http.post(f"{V1}/instances", headers=operator, json={"workflow": "job", "inptu": {}})
    assert (r.status_code, r.json()["detail"]) == (422, "body.inptu: Extra inputs are not permitted")
    assert (await api.engine.client.get(failed)).status == "FAILED"


async def test_a_bulk_action_with_an_empty_filter_is_refused(api: Api) -> None:
    waiting = await api.start("w")
    operator = await api.token("operator")
    for path, extra in (("retry", {}), ("cancel", {"reason": "r"}), ("migrate", {"to_version": 1})):
        r = await api.http.post(f"{V1}/bulk/{path}", headers=operator, json={"filter": {}, **extra})
        assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
        assert "at least one filter" in r.json()["detail"], r.text
    r = await api.http.post(f"{V1}/bulk/cancel", headers=operator,
                            json={"filter": {"workflow": "job"}, "dry_run": True})
    assert (r.status_code, r.json()["matched"]) == (200, 1)
    assert (await api.engine.client.get(waiting)).status == "WAITING"


async def test_a_body_not_sent_as_json_says_to_send_it_as_json(api: Api) -> None:
    """`curl -d '{...}'` without `-H 'content-type: application/json'` sends a form: the JSON in it was
    refused as "body: Input should be a valid dictionary or object to extract fields from", which does
    not say that the body was right and its content type wrong."""
    operator = await api.token("operator")
    for media in ("application/x-www-form-urlencoded", "text/plain"):
        r = await api.http.post(f"{V1}/instances", headers={**operator, "content-type": media},
                                content=b'{"workflow": "job", "input": {"name": "a"}}')
        assert (r.status_code, r.json()["error"], r.json().get("what")) == (422, "InvalidInput", "body"), r.text
        assert r.json()["detail"] == (f"body: sent as {media}, which the API does not read: send JSON, with "
                                      "Content-Type: application/json"), r.text
    assert await api.engine.client.list() == []
