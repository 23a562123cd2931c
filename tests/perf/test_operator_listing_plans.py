"""The operators' reads with optional filters other than the instance lists: after other calls of the
same statement on one connection, a call with a filter still reads that filter's index.

Each filter is written `($n IS NULL OR col = $n)`. A prepared statement (asyncpg's statement cache) takes
its generic plan after five custom ones when that costs less than their average, and a generic plan can
use no index for such a filter. The external-task list and the stranded report did (migration 0066 moved
them into functions planned on every call); the others here kept their custom plans, and this holds them
to it (docs/performance-history.md, "Listings on their custom plans"). Measured as the pages the plan touches
(auto_explain, BUFFERS): after six calls without the filter, the call with it may read little more than on
a fresh connection.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from stepstone.bench.common import bench_queries, seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.model import MAY_RUN
from stepstone.core.pin import pin_of
from stepstone.ops.queries import MAX_REPORT
from stepstone.store.management import management_queries
from stepstone.store.queries import named_queries
from tests.perf.explained import explained, pages_of

ROWS = 20_000

# 2,000 scopes, a task and an external task per instance (1% of the external tasks OPEN, 20 topics), 2,000
# assignees and 1,000 groups, the commands of 2% of the instances dead-lettered, a business key each.
SEED = (
    "UPDATE stepstone.instances SET scope = 't' || abs(hashtext(id::text)) % 2000, business_key = md5(id::text)",
    """INSERT INTO stepstone.tasks (id, instance_id, position, step, visit, scope, definition_id, status, title,
         assignee, candidate_groups, priority, decisions, form, data, state_version, created_at, updated_at)
       SELECT gen_random_uuid(), i.id, '', 'review', 1, i.scope, i.definition_id, 'OPEN', 'Review ' || i.n,
              CASE WHEN i.n % 10 = 0 THEN NULL ELSE 'user' || (i.n % 2000) END, ARRAY['group' || (i.n % 1000)],
              50, '{approve}', '{}', '{}', 1, now() - i.n * interval '1 second', now()
       FROM (SELECT i.*, row_number() OVER () AS n FROM stepstone.instances i) i""",
    """INSERT INTO stepstone.external_tasks (id, instance_id, position, step, visit, topic, status, retries,
         backoff, available_at, created_at, updated_at)
       SELECT gen_random_uuid(), i.id, '', 'charge', 1, 'topic' || (i.n % 20),
              CASE WHEN i.n % 100 = 0 THEN 'OPEN' ELSE 'COMPLETED' END, 3, '{}', now(),
              now() - i.n * interval '1 second', now()
       FROM (SELECT i.*, row_number() OVER () AS n FROM stepstone.instances i) i""",
    "UPDATE stepstone.commands SET state = 'DEAD' WHERE hashtext(instance_id::text) % 50 = 0",
    # a backlog of ready work for the probe's busy read: the timers of 10% of the instances are due
    "UPDATE stepstone.commands SET available_at = now() - interval '1 hour' WHERE hashtext(instance_id::text) % 10 = 1",
    "ANALYZE stepstone.external_tasks",
)


def _cases(instance: Any, key: str, command: int) -> dict[str, tuple[str, str, list[Any], list[Any]]]:
    """name: (the table read, statement, arguments of the other calls, arguments with the filter)."""
    tq = named_queries("tasks.sql", "stepstone")
    inbox_all = "\n".join([tq["task_select"], tq["task_mode_all"], tq["task_filters"], tq["task_page"]])
    inbox = "\n".join([tq["task_select"], tq["task_mode_inbox"], tq["task_filters"], tq["task_page"]])
    count_all = "\n".join([tq["task_count"], tq["task_mode_all"], tq["task_filters"]])
    rest, page = [None] * 9, [None, None, None, 51]
    external = named_queries("external.sql", "stepstone")["external_list"]
    dead = management_queries("stepstone")["dead_commands_page"]
    registry = named_queries("registry.sql", "stepstone")
    ops = named_queries("operations.sql", "stepstone")
    every = [None] * 11 + [True]  # operations.sql's instance_filter: nothing, archived too
    live = list(MAY_RUN)
    report = MAX_REPORT
    by_key = [None, None, None, None, key, *every[5:]]
    return {
        "external tasks of an instance": ("external_tasks", external, [None, None, None, 51, None, None],
                                          [None, None, instance, 51, None, None]),
        "open external tasks of a topic": ("external_tasks", external, [None, None, None, 51, None, None],
                                           ["topic3", "OPEN", None, 51, None, None]),
        "stranded, one scope": ("instances", registry["stranded"], [60, None], [60, ["t5"]]),
        "tasks of an assignee": ("tasks", inbox_all, [None, None, *rest, *page], ["user5", None, *rest, *page]),
        "tasks of a group": ("tasks", inbox_all, [None, None, *rest, *page], [None, ["group5"], *rest, *page]),
        "task count of an assignee": ("tasks", count_all, [None, None, *rest], ["user5", None, *rest]),
        "inbox": ("tasks", inbox, ["user6", ["group9"], *rest, *page], ["user5", ["group7"], *rest, *page]),
        "dead letters, one scope": ("commands", dead, [None, None, 51, None], [["t5"], None, 51, None]),
        "dead letters, next page": ("commands", dead, [None, None, 51, None], [None, command, 51, None]),
        "migration candidates, one scope": ("instances", registry["migration_candidates"],
                                            ["waiting", 1, None, 100, live, None, None],
                                            ["waiting", 1, "t5", 100, live, None, None]),
        # the probe's own limit (MAX_REPORT): its listing took its generic plan after five calls at it
        "probe, one instance": ("commands", ops["open_commands"], [*every, None, report], [*every, instance, report]),
        "probe, a business key": ("commands", ops["open_commands"], [*every, None, report], [*by_key, None, report]),
        "probe, every instance": ("commands", ops["open_commands"], [*every, None, report], [*every, None, report]),
        "probe's busy work, one instance": ("commands", ops["busy_commands"], [*every, None, report],
                                            [*every, instance, report]),
        "probe's busy work, a business key": ("commands", ops["busy_commands"], [*every, None, report],
                                              [*by_key, None, report]),
        "probe's busy work, every instance": ("commands", ops["busy_commands"], [*every, None, report],
                                              [*every, None, report]),
        "stuck, a business key": ("commands", ops["stuck"], [*every, 60.0, 100], [*by_key, 60.0, 100]),
    }


async def test_a_filter_reads_its_index_after_other_calls_of_the_statement(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await seed_waiting(conn, "stepstone", pin_of(waiting), 1, ROWS)
        for statement in SEED:
            await conn.execute(statement)
        await conn.execute(bench_queries("stepstone")["analyze"])
        instance = await conn.fetchval("SELECT instance_id FROM stepstone.external_tasks LIMIT 1")
        key = await conn.fetchval("SELECT business_key FROM stepstone.instances LIMIT 1")
        command = await conn.fetchval("SELECT id FROM stepstone.commands ORDER BY id LIMIT 1 OFFSET 100")
    finally:
        await conn.close()
    found = await _after_other_calls(database_url, _cases(instance, key, command))
    assert {name: f for name, f in found.items() if f[1] > 2 * f[0] + 20} == {}


async def _after_other_calls(
    database_url: str, cases: dict[str, tuple[str, str | tuple[str, str], list[Any], list[Any]]],
) -> dict[str, tuple[int, int, list[str]]]:
    """name: (pages of the call with the filter on a fresh connection, after six calls without it, the
    indexes that call used). A case's statement may be a pair: the store sends the first without the
    filter and the second with it."""
    found = {}
    for name, (table, statement, other, filtered) in cases.items():
        unfiltered, sql = (statement, statement) if isinstance(statement, str) else statement
        conn = await asyncpg.connect(database_url)
        try:
            plans = await explained(conn)
            fresh, _ = await pages_of(conn, plans, table, sql, *filtered)
            for _ in range(6):
                await conn.fetch(unfiltered, *other)
            after, used = await pages_of(conn, plans, table, sql, *filtered)
            found[name] = (fresh, after, used)
        finally:
            await conn.close()
    return found


# 3,000 versions of 300 workflows in 50 scopes (a tenth of them CANDIDATE), an activation of each
# (scope, workflow), 3,000 schedules and 3,000 flow limits in the 50 scopes.
CATALOG_SEED = (
    """INSERT INTO stepstone.definitions (scope, definition_id, version, plan_hash, plan, registered_at, status)
       SELECT 't' || (n % 50), 'wf' || (n % 300), n, md5(n::text), jsonb_build_object('steps', n),
              now() - n * interval '1 minute', CASE WHEN n % 10 = 0 THEN 'CANDIDATE' ELSE 'AVAILABLE' END
       FROM generate_series(1, 3000) n""",
    """INSERT INTO stepstone.definition_activations (scope, definition_id, target_scope, version, activated_at)
       SELECT DISTINCT ON (scope, definition_id) scope, definition_id, scope, version, now()
       FROM stepstone.definitions ORDER BY scope, definition_id, version DESC""",
    """INSERT INTO stepstone.schedules (name, scope, definition_id, spec, input, next_fire_at, created_at,
         updated_at)
       SELECT 'schedule' || n, 't' || (n % 50), 'wf' || (n % 300), '{"every": 60}', '{}',
              now() + n * interval '1 second', now(), now()
       FROM generate_series(1, 3000) n""",
    """INSERT INTO stepstone.flow_limits (scope, definition_id, max_running, updated_at)
       SELECT 't' || (n % 50), 'wf' || n, 1 + n % 10, now() FROM generate_series(1, 3000) n""",
    "ANALYZE stepstone.definitions, stepstone.definition_activations, stepstone.schedules, stepstone.flow_limits",
)


def _catalog_cases() -> dict[str, tuple[str, str | tuple[str, str], list[Any], list[Any]]]:
    """The registry's, the schedules' and the flow limits' listings (`stepstone definitions list`, GET
    /definitions, the UI's definitions, `stepstone schedules list`, `stepstone limits list`), same shape."""
    registry = named_queries("registry.sql", "stepstone")
    scheduling = named_queries("schedules.sql", "stepstone")
    page = management_queries("stepstone")["definitions_page"]
    return {
        "definitions, one scope": ("definitions", registry["list_definitions"], [None, None, None],
                                   ["t5", None, None]),
        "definitions, one workflow": ("definitions", registry["list_definitions"], [None, None, None],
                                      [None, "wf7", None]),
        "definitions, one version's row": ("definitions", registry["list_definitions"], [None, None, None],
                                           ["t7", "wf7", None]),
        "definitions, candidates": ("definitions", registry["list_definitions"], [None, None, None],
                                    [None, None, "CANDIDATE"]),
        "activations, one scope": ("definition_activations", registry["activations"], [None, None],
                                   ["t5", None]),
        "activations, one workflow": ("definition_activations", registry["activations"], [None, None],
                                      [None, "wf7"]),
        "definitions page, one scope": ("definitions", page, [None, None, None, None, 51],
                                        [["t5"], None, None, None, 51]),
        "definitions page, next page": ("definitions", page, [None, None, None, None, 51],
                                        [None, "t5", "wf5", 5, 51]),
        # the whole list and one schedule are statements of their own (store.scheduling.list_schedules)
        "schedules, one": ("schedules", (scheduling["list_schedules"], scheduling["schedule_row"]), [],
                           ["schedule7"]),
        "flow limits, one workflow": ("flow_limits", scheduling["flow_limits"], [None, None], [None, "wf7"]),
        "flow limits, one scope's workflow": ("flow_limits", scheduling["flow_limits"], [None, None], ["t7", "wf7"]),
    }


async def test_a_catalog_filter_reads_its_index_after_other_calls_of_the_statement(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        for statement in CATALOG_SEED:
            await conn.execute(statement)
    finally:
        await conn.close()
    found = await _after_other_calls(database_url, _catalog_cases())
    assert {name: f for name, f in found.items() if f[1] > 2 * f[0] + 20} == {}
