"""What each enabled row trigger of the step commit's tables adds to a one-row statement.

Not a test (pytest does not collect it): the harness behind "Trigger conditions" in docs/performance-history.md.
PostgreSQL reads a trigger's WHEN back from its stored form and prepares it once per statement, and a
step commit writes one row per statement, so that cost is paid on every commit. For each enabled
trigger of instances, positions, commands and history, this copies the table's columns (no
constraints, no indexes, no other triggers), attaches the trigger with its own events and WHEN but a
function that does nothing, and times 2,000 one-row statements in a plpgsql loop with and without it
(median of 7, after one to warm up). The rows keep every WHEN false, as on a plain step commit, so
what is measured is the condition and, for a trigger without one, the call. (The UPDATE column of
instances_admit_pin is not one to read: its column list does not meet the update's.)

    python tests/perf/trigger_conditions.py --url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.store.migrate import migrate

SCHEMA = "stepstone"
# One row as a plain step commit writes it, and the statement that changes it.
STATEMENTS = {
    "instances": ("INSERT INTO {t} (status) VALUES ('RUNNING')", "UPDATE {t} SET status = 'RUNNING'"),
    "positions": ("INSERT INTO {t} (status) VALUES ('RUNNING')", "UPDATE {t} SET status = 'RUNNING'"),
    "commands": ("INSERT INTO {t} (kind, state, definition) VALUES ('STEP', 'CLAIMED', 'orders')",
                 "UPDATE {t} SET state = 'COMPLETED', available_at = now()"),
    "history": ("INSERT INTO {t} (kind) VALUES ('STEP_COMPLETED')", None),
}


async def per_statement(conn: asyncpg.Connection, table: str, body: str) -> float:
    await conn.execute(f"""CREATE OR REPLACE FUNCTION pg_temp.timed(n integer) RETURNS float8
        LANGUAGE plpgsql AS $$
        DECLARE t0 timestamptz := clock_timestamp();
        BEGIN
            FOR i IN 1..n LOOP {body}; END LOOP;
            RETURN extract(epoch FROM clock_timestamp() - t0) * 1e6 / n;
        END $$""")
    runs = []
    for _ in range(8):
        await conn.execute(f"TRUNCATE {table}")
        runs.append(await conn.fetchval("SELECT pg_temp.timed(2000)"))
    return float(statistics.median(runs[1:]))  # the first warms the caches up


async def measure(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, SCHEMA)
        triggers = await conn.fetch(
            """SELECT c.relname AS rel, t.tgname AS name, pg_get_triggerdef(t.oid) AS def
               FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
               WHERE NOT t.tgisinternal AND t.tgenabled <> 'D' AND c.relnamespace = $1::regnamespace
                 AND c.relname = ANY($2::text[])
               ORDER BY 1, 2""", SCHEMA, list(STATEMENTS))
        await conn.execute("CREATE FUNCTION pg_temp.nothing() RETURNS trigger LANGUAGE plpgsql AS "
                           "$$ BEGIN RETURN NULL; END $$")
        print(f"{'trigger':34} {'insert µs':>10} {'update µs':>10}")  # noqa: T201 - the output
        for row in triggers:
            copy = f"pg_temp.copy_{row['rel']}"
            await conn.execute(f"DROP TABLE IF EXISTS {copy}; "
                               f"CREATE TABLE {copy} AS SELECT * FROM {SCHEMA}.{row['rel']} WITH NO DATA")
            definition = re.sub(r"EXECUTE FUNCTION .*$", "EXECUTE FUNCTION pg_temp.nothing()", row["def"])
            definition = definition.replace(f" ON {SCHEMA}.{row['rel']} ", f" ON {copy} ")
            definition = re.sub(r"^CREATE (CONSTRAINT )?TRIGGER \S+", r"CREATE \1TRIGGER measured", definition)
            insert, update = STATEMENTS[row["rel"]]
            cells = []
            for statement in (insert, update):
                if statement is None:
                    cells.append("")
                    continue
                body = statement.format(t=copy)
                if statement.startswith("UPDATE"):
                    body = f"IF i = 1 THEN {insert.format(t=copy)}; END IF; {body}"
                without = await per_statement(conn, copy, body)
                await conn.execute(definition)
                with_it = await per_statement(conn, copy, body)
                await conn.execute(f"DROP TRIGGER measured ON {copy}")
                cells.append(f"{with_it - without:+.1f}")
            print(f"{row['name']:34} {cells[0]:>10} {cells[1]:>10}")  # noqa: T201
    finally:
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="a server where this may create (and drops) a database")
    args = parser.parse_args()
    async with scratch_database(args.url, "stepstone_triggers") as url:
        await measure(url)


if __name__ == "__main__":
    asyncio.run(main())
