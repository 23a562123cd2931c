"""Workflow documents over HTTP (`POST /definitions/validate`, `POST /definitions/publish`): the checks of
`stepstone definitions validate` and `publish`, every problem as problem+json at its place, the roles, and
what a server without the handlers' catalog can publish."""

from __future__ import annotations

from typing import Any

from stepstone.examples.document_catalog import catalog
from tests.api.conftest import Api
from tests.registry.test_documents import APPROVAL  # the approval document of docs/versions.md

V1 = "/api/v1"
WAITS_ONLY = """id: gate
version: 1
scope: acme
steps:
  - name: wait
    kind: wait
    start: true
    signals: {open: $end}
"""


async def _post(api: Api, what: str, headers: dict[str, str], document: str, **more: Any) -> Any:
    return await api.http.post(f"{V1}/definitions/{what}", headers=headers, json={"document": document, **more})


async def test_validate_reports_every_problem_at_its_place(api: Api) -> None:
    viewer = await api.token("viewer")
    valid = await _post(api, "validate", viewer, APPROVAL)
    assert valid.status_code == 200, valid.text
    assert valid.json() | {"plan_hash": ""} == {"valid": True, "workflow": "approval", "version": 1,
                                                "scope": "default", "steps": 3, "plan_hash": "",
                                                "handlers_checked": False}
    broken = APPROVAL.replace("handler: ship", "handler: shipp").replace("next: await_decision", "next: nowhere")
    r = await _post(api, "validate", viewer, broken)
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["error"] == "DocumentInvalid"
    # the stage of the steps named fails first, before the catalog's
    assert [(p["path"], p["line"], p["column"]) for p in body["problems"]] == [("steps[0].next", 8, 11)]
    assert (body["path"], body["line"]) == ("steps[0].next", 8)
    api.ctx.catalog = catalog  # `stepstone serve --catalog stepstone.examples.document_catalog:catalog`
    r = await _post(api, "validate", viewer, APPROVAL.replace("handler: ship", "handler: shipp")
                    .replace("handler: review", "handler: reveiw"))
    assert [p["path"] for p in r.json()["problems"]] == ["steps[0].handler", "steps[2].handler"]
    assert "unknown handler 'shipp' (the catalog has: review, ship)" in r.json()["problems"][1]["message"]
    assert (await _post(api, "validate", viewer, APPROVAL)).json()["handlers_checked"] is True
    unparsed = await _post(api, "validate", viewer, "{not json", format="json")
    assert unparsed.status_code == 422 and unparsed.json()["problems"][0]["line"] == 1
    assert (await api.http.post(f"{V1}/definitions/validate", json={"document": APPROVAL})).status_code == 401


async def test_publish_binds_against_the_servers_catalog(api: Api) -> None:
    operator = await api.token("operator")
    # without a catalog the server has none of the handlers: each one named is refused, nothing is written
    r = await _post(api, "publish", operator, APPROVAL)
    assert r.status_code == 422 and r.json()["error"] == "DocumentInvalid", r.text
    assert [p["path"] for p in r.json()["problems"]] == ["steps[0].handler", "steps[2].handler"]
    assert "(the catalog has: none)" in r.json()["detail"]
    assert await api.engine.store.definitions.records(definition_id="approval") == []
    # a document that names no handler needs none
    gate = await _post(api, "publish", operator, WAITS_ONLY)
    assert gate.status_code == 200, gate.text
    assert gate.json() | {"plan_hash": ""} == {"workflow": "gate", "version": 1, "scope": "acme", "plan_hash": "",
                                               "status": "AVAILABLE", "recorded": "inserted"}
    api.ctx.catalog = catalog
    done = await _post(api, "publish", operator, APPROVAL)
    assert done.status_code == 200 and done.json()["status"] == "AVAILABLE", done.text
    [record] = await api.engine.store.definitions.records(definition_id="approval")
    assert (record.status, record.kind, record.plan_hash) == ("AVAILABLE", "DOCUMENT", done.json()["plan_hash"])
    again = await _post(api, "publish", operator, APPROVAL)
    assert again.json()["recorded"] == "unchanged"
    drift = await _post(api, "publish", operator, APPROVAL.replace("timeout: 3600", "timeout: 60"))
    assert drift.status_code == 409 and drift.json()["error"] == "DefinitionDrift"


async def test_publish_takes_the_operator_role_in_the_documents_scope(api: Api) -> None:
    viewer = await _post(api, "publish", await api.token("viewer"), WAITS_ONLY)
    assert viewer.status_code == 403 and viewer.json()["error"] == "Forbidden"
    other = await _post(api, "publish", await api.token("operator", "globex"), WAITS_ONLY)
    assert other.status_code == 403 and other.json()["scope"] == "acme"
    assert await api.engine.store.definitions.records(definition_id="gate") == []
    tenant = await _post(api, "publish", await api.token("operator", "acme"), WAITS_ONLY)
    assert tenant.status_code == 200, tenant.text


async def test_a_viewer_is_refused_publishing_before_its_document_is_checked(api: Api) -> None:
    """The document was validated before the role was checked: a viewer's invalid document (or a body
    without one) got 422 with the document's problems, a valid one 403."""
    viewer = await api.token("viewer", "acme")
    invalid = WAITS_ONLY.replace("kind: wait", "kind: nonsense")
    for body in ({"document": invalid}, {}, {"document": "{", "format": "json"}):
        r = await api.http.post(f"{V1}/definitions/publish", headers=viewer, json=body)
        assert r.status_code == 403, (body, r.text)
        assert r.json()["error"] == "Forbidden" and r.json()["role"] == "operator", r.text
        assert "needs the operator role in the document's scope" in r.json()["detail"]
    # An operator of some scope still learns what is wrong with the document.
    r = await _post(api, "publish", await api.token("operator", "globex"), WAITS_ONLY.replace("kind: wait", "kind: x"))
    assert r.status_code == 422 and r.json()["error"] == "DocumentInvalid", r.text


async def test_a_read_only_server_refuses_both(read_only_api: Api) -> None:
    admin = await read_only_api.token("admin")
    for what in ("validate", "publish"):
        r = await _post(read_only_api, what, admin, WAITS_ONLY)
        assert r.status_code == 405 and r.json()["error"] == "ReadOnly"
