"""Document-defined workflows: the schema, the catalog, the size limit, the digest, publishing and running."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stepstone.authoring.documents import Catalog, load_document, schema
from stepstone.authoring.workflow import Registry, StepContext
from stepstone.cli import cli
from stepstone.core.pin import pin_of
from stepstone.errors import (
    DefinitionDrift,
    DocumentInvalid,
    DocumentTampered,
    InvalidTransition,
    VersionNotAdmitted,
)
from stepstone.ops.definitions import load_published, publish_document
from stepstone.runtime.worker import Worker
from stepstone.testing import open_engine

catalog = Catalog()


@catalog.handler("review")
async def review(ctx: StepContext, state: dict[str, Any]) -> None:
    state["reviewed"] = ctx.workflow


@catalog.handler("ship")
def ship(_ctx: StepContext, state: dict[str, Any]) -> None:
    state["shipped"] = True


APPROVAL = """\
id: approval
version: 1
steps:
  - name: review
    kind: action
    handler: review
    start: true
    next: await_decision
  - name: await_decision
    kind: wait
    signals: {approved: ship, rejected: $end}
    timeout: 3600
    on_timeout: ship
  - name: ship
    kind: action
    handler: ship
"""


def test_a_document_becomes_a_workflow_with_a_structural_hash() -> None:
    wf = load_document(APPROVAL, catalog)
    assert (wf.id, wf.version, wf.scope, list(wf.plan.steps)) == ("approval", 1, "default",
                                                                  ["review", "await_decision", "ship"])
    assert wf.plan.signal_names == {"approved", "rejected"}
    as_json = json.dumps({"id": "approval", "version": 1, "steps": [
        {"name": "review", "kind": "action", "handler": "review", "start": True, "next": "await_decision"},
        {"name": "await_decision", "kind": "wait", "signals": {"approved": "ship", "rejected": "$end"},
         "timeout": 3600, "on_timeout": "ship"},
        {"name": "ship", "kind": "action", "handler": "ship"}]})
    assert load_document(as_json, catalog, fmt="json").plan.plan_hash == wf.plan.plan_hash
    assert load_document(APPROVAL, None).plan.plan_hash == wf.plan.plan_hash  # handlers are not structure


@pytest.mark.parametrize(("text", "line", "column", "path", "words"), [
    (APPROVAL.replace("kind: wait", "kind: sleep"), 10, 11, "steps[1].kind", "'sleep' is not one of"),
    (APPROVAL.replace("    on_timeout: ship\n", "    on_timeout: ship\n    colour: red\n"), 14, 5,
     "steps[1].colour", "unknown field 'colour'"),
    (APPROVAL.replace("version: 1", "version: 0"), 2, 10, "version", "less than the minimum"),
    (APPROVAL.replace("handler: ship", "handler: shipp"), 16, 14, "steps[2].handler", "unknown handler 'shipp'"),
    (APPROVAL.replace("signals: {approved: ship,", "signals: {approved: ship:"), 11, 29, "", "not valid YAML"),
])
def test_invalid_documents_name_the_line_column_and_path(
    text: str, line: int, column: int, path: str, words: str
) -> None:
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, catalog)
    err = raised.value
    assert (err.line, err.column) == (line, column), str(err)
    assert err.path == path and words in str(err)
    assert str(err).startswith(f"line {line}, column {column}")


def test_a_character_yaml_does_not_take_is_a_problem_of_the_document(tmp_path: Path) -> None:
    """PyYAML's reader refuses a control character when the loader is made, which was outside the parse's
    translation: load_document raised yaml's ReaderError (a traceback from `definitions validate`, a 500
    from the API's POST /definitions/validate)."""
    with pytest.raises(DocumentInvalid, match="not valid YAML: special characters are not allowed #x0008 at "
                                              "character 3"):
        load_document("id:\x08 x", catalog)
    (tmp_path / "bell.yaml").write_text(APPROVAL.replace("version: 1", "version: 1\x07"), encoding="utf-8")
    done = CliRunner().invoke(cli, ["definitions", "validate", str(tmp_path / "bell.yaml")])
    assert done.exit_code == 1 and done.stderr.startswith("error: not valid YAML: special characters"), done.output


def test_graph_problems_and_the_size_limit() -> None:
    with pytest.raises(DocumentInvalid, match="goes to unknown step 'nowhere'"):
        load_document(APPROVAL.replace("next: await_decision", "next: nowhere"), catalog)
    with pytest.raises(DocumentInvalid, match="over the limit of 100 bytes"):
        load_document(APPROVAL, catalog, max_bytes=100)
    with pytest.raises(DocumentInvalid, match="line 1, column 10: not valid JSON"):
        load_document('{"id": 1,}', catalog, fmt="json")


def test_the_published_schema_is_shipped_in_the_package_and_the_docs() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "workflow-document.schema.json"
    assert json.loads(docs.read_text()) == schema()


async def test_publish_run_and_digest_check(database_url: str) -> None:
    async with open_engine(database_url, Registry()) as engine:
        defs = engine.store.definitions
        published = await publish_document(defs, APPROVAL, catalog)
        assert (published.status, published.recorded) == ("AVAILABLE", "inserted")
        again = await publish_document(defs, APPROVAL, catalog)
        assert (again.status, again.recorded) == ("AVAILABLE", "unchanged")
        with pytest.raises(DefinitionDrift) as drift:
            await publish_document(defs, APPROVAL.replace("timeout: 3600", "timeout: 60"), catalog)
        assert "but this document has plan" in str(drift.value), str(drift.value)  # there is no code here
        [record] = await defs.records(definition_id="approval")
        assert (record.kind, record.status, record.active) == ("DOCUMENT", "AVAILABLE", True)

        loaded = await load_published(defs, catalog)
        registry = Registry(*loaded)
        client = type(engine.client)(engine.store, registry)
        iid = await client.start("approval", {})
        worker = Worker(engine.store, registry)
        await worker.run_until_idle()
        await client.signal(iid, "approved")
        await worker.run_until_idle()
        info = await client.get(iid)
        assert info.status == "COMPLETED" and info.state == {"reviewed": "approval", "shipped": True}

        pool = engine.store.pool
        await pool.execute("UPDATE stepstone.definitions SET document = document || '# edited' "
                           "WHERE definition_id = 'approval'")
        with pytest.raises(DocumentTampered, match="no longer matches its SHA-256 digest"):
            await defs.document("default", "approval", 1)
        assert uuid.UUID(iid)


async def test_an_unpublished_candidate_takes_no_instances(database_url: str) -> None:
    async with open_engine(database_url, Registry()) as engine:
        wf = load_document(APPROVAL, catalog)
        await engine.store.definitions.record(pin_of(wf), wf.plan.document(), kind="DOCUMENT", status="CANDIDATE",
                                              document=APPROVAL, document_format="yaml")
        client = type(engine.client)(engine.store, Registry(wf))
        client._registered.add(("approval", 1))
        with pytest.raises(VersionNotAdmitted, match="is CANDIDATE"):
            await client.start(wf, {})


def test_cli_validate_and_publish(database_url: str, tmp_path: Path) -> None:
    good = tmp_path / "approval.yaml"
    good.write_text(APPROVAL)
    bad = tmp_path / "bad.yaml"
    bad.write_text(APPROVAL.replace("handler: ship", "handler: shipp"))
    runner = CliRunner()
    cat = "tests.registry.test_documents:catalog"
    ok = runner.invoke(cli, ["definitions", "validate", str(good), "--catalog", cat])
    assert ok.exit_code == 0 and ok.stdout.startswith("valid: approval v1 (scope default), 3 steps"), ok.output
    one = tmp_path / "one.yaml"
    one.write_text("id: one\nversion: 1\nsteps:\n  - {name: a, kind: action, handler: review}\n")
    ok = runner.invoke(cli, ["definitions", "validate", str(one), "--catalog", cat])
    assert ok.exit_code == 0 and ok.stdout.startswith("valid: one v1 (scope default), 1 step, plan "), ok.output
    refused = runner.invoke(cli, ["definitions", "validate", str(bad), "--catalog", cat])
    assert refused.exit_code == 1
    assert refused.stderr.strip() == ("error: line 16, column 14 (steps[2].handler): unknown handler 'shipp' "
                                      "(the catalog has: review, ship)")
    published = runner.invoke(cli, ["definitions", "publish", str(good), "--catalog", cat,
                                    "--database-url", database_url])
    assert published.exit_code == 0, published.output
    assert published.stdout.startswith("published approval v1 (scope default, plan ")
    listed = runner.invoke(cli, ["definitions", "list", "-o", "json", "--database-url", database_url])
    assert [(r["workflow"], r["kind"], r["status"]) for r in json.loads(listed.stdout)] == [
        ("approval", "DOCUMENT", "AVAILABLE")]
    shown = runner.invoke(cli, ["definitions", "show", "approval", "1", "--database-url", database_url])
    assert shown.exit_code == 0 and "handler: review" in shown.stdout
    not_available = runner.invoke(cli, ["definitions", "activate", "approval", "2", "--database-url", database_url])
    assert not_available.exit_code == 1
    assert "only an AVAILABLE version can be activated" in not_available.stderr


async def test_publication_is_claimed_with_a_token_and_an_obsolete_completion_fails(database_url: str) -> None:
    async with open_engine(database_url, Registry()) as engine:
        defs = engine.store.definitions
        wf = load_document(APPROVAL, catalog)
        pin = pin_of(wf)
        await defs.record(pin, wf.plan.document(), kind="DOCUMENT", status="CANDIDATE", document=APPROVAL,
                          document_format="yaml")
        first = await defs.claim_publication(pin)
        with pytest.raises(InvalidTransition, match="is PUBLISHING"):
            await defs.claim_publication(pin)
        await engine.move_clock(61)  # the first publisher went quiet: its claim is stale
        second = await defs.claim_publication(pin)
        with pytest.raises(InvalidTransition, match="taken over"):
            await defs.complete_publication(pin, first)
        await defs.complete_publication(pin, second)
        assert (await defs.find("default", "approval", 1))["status"] == "AVAILABLE"


BIG = APPROVAL.replace("id: approval", "id: big") + "# " + "x" * 300_000 + "\n"  # over the default limit


def test_a_document_published_under_a_larger_limit_stays_readable_and_one_bad_document_stops_no_other(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """show and load_published applied the default limit again to what publish --max-bytes had accepted
    (as DocumentTampered), and load_published raised on the first bad document, so none loaded. Sync:
    the CLI runs its own event loop."""
    with caplog.at_level(logging.ERROR, logger="stepstone.definitions"):
        asyncio.run(_publish_big_then_tamper_another(database_url))
    assert "approval v1 (scope default) not loaded: " in caplog.text
    assert "no longer matches its SHA-256 digest" in caplog.text
    shown = CliRunner().invoke(cli, ["definitions", "show", "big", "1", "--database-url", database_url])
    assert shown.exit_code == 0 and "handler: review" in shown.stdout, shown.output


async def _publish_big_then_tamper_another(database_url: str) -> None:
    async with open_engine(database_url, Registry()) as engine:
        defs = engine.store.definitions
        with pytest.raises(DocumentInvalid, match="over the limit"):
            await publish_document(defs, BIG, catalog)
        await publish_document(defs, BIG, catalog, max_bytes=400_000)
        await publish_document(defs, APPROVAL, catalog)
        assert (await defs.document("default", "big", 1))[0] == BIG
        assert sorted(wf.id for wf in await load_published(defs, catalog)) == ["approval", "big"]
        await engine.store.pool.execute("UPDATE stepstone.definitions SET document = document || '# edited' "
                                        "WHERE definition_id = 'approval'")
        assert [wf.id for wf in await load_published(defs, catalog)] == ["big"]


def test_every_problem_of_a_stage_is_reported_not_only_the_first(tmp_path: Path) -> None:
    """A document with three schema problems was refused for the first alone: fixed, it was refused for
    the next, and so on. A validator reports them all, each at its place, as do the unknown steps."""
    text = (APPROVAL.replace("kind: wait", "kind: sleep").replace("version: 1", "version: 0")
            .replace("    handler: ship\n", "    handler: ship\n    colour: red\n"))
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, catalog)
    err = raised.value
    assert [(p["line"], p["column"], p["path"]) for p in err.problems] == [
        (2, 10, "version"), (10, 11, "steps[1].kind"), (17, 5, "steps[2].colour")], err.problems
    assert (err.line, err.column, err.path) == (2, 10, "version")  # the first one's place
    assert str(err).startswith("3 problems: line 2, column 10 (version): ") and "unknown field 'colour'" in str(err)
    targets = APPROVAL.replace("next: await_decision", "next: nowhere").replace("on_timeout: ship", "on_timeout: gone")
    with pytest.raises(DocumentInvalid) as raised:
        load_document(targets, catalog)
    assert [p["path"] for p in raised.value.problems] == ["steps[0].next", "steps[1].on_timeout"]
    doc = tmp_path / "approval.yaml"
    doc.write_text(text)
    result = CliRunner().invoke(cli, ["definitions", "validate", str(doc)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: 3 problems in the document:",
        "  line 2, column 10 (version): 0 is less than the minimum of 1",
        "  line 10, column 11 (steps[1].kind): " + err.problems[1]["message"],
        "  line 17, column 5 (steps[2].colour): unknown field 'colour'"], result.stderr


NAMES = """\
id: x
version: 1
state: nomodel
steps:
  - {name: a, kind: action, handler: review, start: true, next: w}
  - name: w
    kind: wait
    signals: {go: b}
    payloads: {go: missing_model}
  - name: b
    kind: action
    handler: shipp
    compensation: {handler: undo}
  - {name: c, kind: child, workflow: y, handler: nope, next: $end}
"""
GRAPH = """\
id: x
version: 1
steps:
  - {name: a, kind: action, handler: review, start: true, next: b, deadline: 1e300}
  - {name: b, kind: action, handler: ship}
  - {name: c, kind: action, handler: ship, next: b}
  - {name: w, kind: wait, signals: {go: b}, payloads: {stop: note}}
  - {name: j, kind: join, fork: a, next: b}
"""


def test_the_catalog_and_graph_stages_report_every_problem_too(tmp_path: Path) -> None:
    """The catalog's names and the graph's rules stopped at the first problem (an unknown state model hid
    three unknown handlers; a deadline past a thousand years hid an unreachable step): a user fixed one,
    published again, and met the next. Each stage now reports all of its problems, each at its place."""
    with pytest.raises(DocumentInvalid) as raised:
        load_document(NAMES, catalog)
    assert [(p["path"], p["line"], p["column"]) for p in raised.value.problems] == [
        ("state", 3, 8), ("steps[1].payloads.go", 9, 20), ("steps[2].handler", 12, 14),
        ("steps[2].compensation.handler", 13, 29), ("steps[3].handler", 14, 50)], raised.value.problems
    assert [p["message"].split(" (")[0] for p in raised.value.problems] == [
        "unknown state model 'nomodel'", "unknown payload model 'missing_model'", "unknown handler 'shipp'",
        "unknown handler 'undo'", "unknown handler 'nope'"]
    with pytest.raises(DocumentInvalid) as raised:
        load_document(GRAPH, None)  # structure only: the catalog's names are not asked
    assert [(p["path"], p["message"]) for p in raised.value.problems] == [
        ("steps", "unreachable steps: c, j, w"),  # w too: its payload is wrong, and nothing goes to it
        ("steps[0].deadline", "step 'a': its deadline must be at most a thousand years, got 1e+300 s"),
        ("steps[3].payloads.stop", "payload for 'stop', which is none of the wait's signals and messages"),
        ("steps[4]", "join step 'j' names no fork: 'a' is not a fork step")]  # a rule about one step, at that step
    # (in the document's words, not Python's `fork='a'`)
    assert str(raised.value).startswith("4 problems: line 4, column 3 (steps): unreachable steps: c, j, w; ")
    doc = tmp_path / "x.yaml"
    doc.write_text(NAMES)
    shown = CliRunner().invoke(cli, ["definitions", "validate", str(doc), "--catalog",
                                     "tests.registry.test_documents:catalog"])
    assert shown.exit_code == 1
    assert shown.stderr.splitlines()[:2] == [
        "error: 5 problems in the document:",
        "  line 3, column 8 (state): unknown state model 'nomodel' (the catalog has: none)"], shown.stderr
    doc.write_text(GRAPH)
    as_json = CliRunner().invoke(cli, ["definitions", "validate", str(doc), "-o", "json"])
    assert as_json.exit_code == 1
    found = json.loads(as_json.stdout)
    assert found["valid"] is False
    assert [p["path"] for p in found["problems"]] == ["steps", "steps[0].deadline", "steps[3].payloads.stop",
                                                      "steps[4]"]


REFUND = """\
id: refund
version: 1
steps:
  - {name: decide, kind: task, start: true, title: Approve, decisions: {approve: pay, reject: $end},
     payloads: {aprove: note}}
  - {name: pay, kind: wait, signals: {paid: ship}}
  - {name: ship, kind: action, handler: ship}
"""
CHAIN = """\
id: chain
version: 1
steps:
  - {name: a, kind: action, handler: review, start: true, next: w}
  - {name: w, kind: wait, signals: {go: b}, payloads: {og: note}}
  - {name: b, kind: action, handler: ship, next: c}
  - {name: c, kind: action, handler: ship}
"""
ALONE = """\
id: alone
version: 1
steps:
  - {name: w, kind: wait, start: true, signals: {go: $end}, payloads: {og: note}}
"""


@pytest.mark.parametrize("text", [REFUND, CHAIN, ALONE], ids=["start", "middle", "alone"])
def test_a_step_that_cannot_be_added_makes_no_graph_problem_of_its_own(text: str) -> None:
    """A step refused for one of its fields (a payload for a decision it lacks) was left out of the graph
    the rules then checked, which reported what its absence made: "no start step" for a start step
    marked `start: true`, "no steps" for a document of one, the steps after it "unreachable". Only the
    field's problem is reported now."""
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, None)
    assert [p["message"] for p in raised.value.problems] == [raised.value.problems[0]["message"]], \
        raised.value.problems
    assert raised.value.problems[0]["message"].startswith("payload for "), raised.value.problems
