"""Messages and signal-with-start over HTTP, and who may send them."""

from __future__ import annotations

from tests.api.conftest import Api

V1 = "/api/v1"


async def test_publish_delivers_to_the_waiting_instance_buffers_and_dedups(api: Api) -> None:
    operator = await api.token("operator")
    iid = await api.engine.client.start("order", {"order_id": "o-1"})
    await api.engine.run_until_idle()
    body = {"name": "receipt", "correlation_key": "o-1", "payload": {"n": 1}, "message_id": "m-1"}
    r = await api.http.post(f"{V1}/messages", headers=operator, json=body)
    assert r.status_code == 200
    assert r.json()["outcome"] == "delivered"
    assert [d["instance_id"] for d in r.json()["deliveries"]] == [iid]
    again = await api.http.post(f"{V1}/messages", headers=operator, json=body)
    assert (again.json()["duplicate"], again.json()["deliveries"]) == (True, r.json()["deliveries"])
    other = await api.http.post(f"{V1}/messages", headers=operator, json={**body, "payload": {"n": 2}})
    assert (other.status_code, other.json()["error"]) == (409, "IdempotencyConflict")
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).state["got"] == "filed"
    r = await api.http.post(f"{V1}/messages", headers=operator,
                            json={"name": "receipt", "correlation_key": "o-2", "ttl": 60})
    assert r.json()["outcome"] == "buffered" and r.json()["expires_at"]
    r = await api.http.post(f"{V1}/messages", headers=operator, json={"name": "receipt", "correlation_key": "o-3"})
    assert r.json()["outcome"] == "dropped"
    r = await api.http.post(f"{V1}/messages", headers=operator, json={"name": "receipt", "correlation_key": "o",
                                                                     "ttl": -1})
    assert r.status_code == 422
    # "NaN" and 1e400 (infinity) were refused as "Input should be less than or equal to 315360000".
    for ttl in ('"NaN"', "1e400", '"-Infinity"'):
        r = await api.http.post(f"{V1}/messages", headers={**operator, "content-type": "application/json"},
                                content=f'{{"name": "receipt", "correlation_key": "o", "ttl": {ttl}}}')
        assert (r.status_code, r.json()["detail"]) == (422, "body.ttl: Input should be a finite number"), ttl


async def test_start_or_signal_starts_once_then_signals(api: Api) -> None:
    operator = await api.token("operator", scope="default")
    body = {"workflow": "order", "business_key": "b-1", "signal": "nudge", "input": {"order_id": "x"}}
    first = await api.http.post(f"{V1}/start-or-signal", headers=operator, json=body)
    assert first.status_code == 202
    assert (first.json()["started"], first.json()["scope"]) == (True, "default")
    await api.engine.run_until_idle()
    info = await api.engine.client.get(first.json()["instance_id"])
    assert (info.status, info.state["got"]) == ("COMPLETED", "filed by v2")  # the latest version
    r = await api.http.post(f"{V1}/start-or-signal", headers=operator, json={**body, "signal": "nope"})
    assert (r.status_code, r.json()["error"]) == (422, "UnknownSignal"), r.text  # as /signal answers it
    assert "has no signal named 'nope'" in r.json()["detail"]


async def test_who_may_send_messages_and_signals(api: Api) -> None:
    body = {"name": "receipt", "correlation_key": "k"}
    start = {"workflow": "order", "business_key": "b", "signal": "nudge", "input": {"order_id": "y"}}
    assert (await api.http.post(f"{V1}/messages", json=body)).status_code == 401
    assert (await api.http.post(f"{V1}/start-or-signal", json=start)).status_code == 401
    scoped = await api.token("operator", scope="default")
    r = await api.http.post(f"{V1}/messages", headers=scoped, json=body)
    assert (r.status_code, r.json()["role"], r.json()["scope"]) == (403, "operator", "*")
    other = await api.token("admin", scope="acme")
    r = await api.http.post(f"{V1}/start-or-signal", headers=other, json=start)
    assert (r.status_code, r.json()["error"]) == (404, "DefinitionNotFound")
    viewer = await api.token("viewer")
    for path, payload in (("messages", body), ("start-or-signal", start)):
        assert (await api.http.post(f"{V1}/{path}", headers=viewer, json=payload)).status_code == 403
    started = await api.ctx.management.instances_page(None, definition="order", business_key="b",
                                                      after=None, limit=5)
    assert started == []  # no refused call started anything


async def test_start_or_signal_keeps_a_business_key_per_scope(api: Api) -> None:
    acme = await api.token("operator", scope="acme")
    body = {"workflow": "order", "business_key": "b-7", "signal": "nudge", "input": {"order_id": "z"},
            "scope": "acme"}
    first = await api.http.post(f"{V1}/start-or-signal", headers=acme, json=body)
    assert (first.status_code, first.json()["started"], first.json()["scope"]) == (202, True, "acme")
    shown = await api.http.get(f"{V1}/instances/{first.json()['instance_id']}", headers=acme)
    assert (shown.status_code, shown.json()["scope"]) == (200, "acme")
    # The same key in the default scope is another instance; acme's token may not reach that scope.
    r = await api.http.post(f"{V1}/start-or-signal", headers=acme, json={**body, "scope": "default"})
    assert (r.status_code, r.json()["error"]) == (404, "DefinitionNotFound")
    default = await api.token("operator", scope="default")
    second = await api.http.post(f"{V1}/start-or-signal", headers=default, json={**body, "scope": "default"})
    assert second.json()["started"] is True and second.json()["instance_id"] != first.json()["instance_id"]
    again = await api.http.post(f"{V1}/start-or-signal", headers=acme, json=body)
    assert (again.json()["started"], again.json()["instance_id"]) == (False, first.json()["instance_id"])


async def test_start_or_signal_needs_no_input_when_the_instance_exists(api: Api) -> None:
    """The input is the instance's when this call starts it: an existing instance is signalled without one,
    and only a call that would start an instance with an invalid input is refused."""
    operator = await api.token("operator", scope="default")
    iid = await api.engine.client.start("job", {"name": "k"}, business_key="jk-2")
    await api.engine.run_until_idle()
    body = {"workflow": "job", "business_key": "jk-2", "signal": "reject", "dedup_key": "d-1"}
    r = await api.http.post(f"{V1}/start-or-signal", headers=operator, json=body)
    assert (r.status_code, r.json()["instance_id"], r.json()["started"]) == (202, iid, False), r.text
    again = await api.http.post(f"{V1}/start-or-signal", headers=operator,
                                json={**body, "input": {"name": "k"}})  # the same signal: a duplicate
    assert again.json()["command_id"] == r.json()["command_id"], again.text
    await api.engine.run_until_idle()
    assert (await api.engine.client.get(iid)).state["log"] == ["charged", "refunded"]
    r = await api.http.post(f"{V1}/start-or-signal", headers=operator,
                            json={**body, "business_key": "jk-3"})
    assert (r.status_code, r.json()["error"]) == (422, "InvalidInput"), r.text
    assert "name" in r.json()["detail"]
    started = await api.ctx.management.instances_page(None, definition="job", business_key="jk-3",
                                                      after=None, limit=5)
    assert started == []


async def test_a_key_that_is_not_text_is_matched_as_its_json_text(api: Api) -> None:
    """A JSON client's `true` or `7` as the key: its JSON text, as a wait makes the key of a state value
    (a 422 before: the body's key had to be a string)."""
    operator = await api.token("operator")
    ids = [await api.engine.client.start("order", {"order_id": k}) for k in ("true", "7")]
    await api.engine.run_until_idle()
    for key in ("true", "7"):
        r = await api.http.post(f"{V1}/messages", headers={**operator, "content-type": "application/json"},
                                content=f'{{"name": "receipt", "correlation_key": {key}}}')
        assert (r.status_code, r.json().get("outcome")) == (200, "delivered"), r.text
    await api.engine.run_until_idle()
    assert [(await api.engine.client.get(i)).state["got"] for i in ids] == ["filed", "filed"]
