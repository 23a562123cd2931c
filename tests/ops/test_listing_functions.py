"""The operations' list and counts run in functions (migration 0064: find_instances, count_instances), and so
does the probe's listing (0071: probe_listing), that state operations.sql's `instance_filter` again (and the
listing its `probe_columns`), so that each is planned with its arguments; the stuck report and the probe's
busy work compose the fragments. Both must mean the same."""

from __future__ import annotations

import re

from stepstone.store.queries import named_queries
from stepstone.store.sqlfiles import read_text, render

ARGUMENTS = ["p_statuses", "p_definition", "p_version", "p_scope", "p_key", "p_key_like", "p_parent",
             "p_created_since", "p_created_until", "p_updated_since", "p_updated_until", "p_archived"]


def _plain(sql: str) -> str:
    return " ".join(sql.split())


def test_the_list_and_counts_state_the_filters_of_instance_filter() -> None:
    fragment = named_queries("operations.sql", "stepstone")["instance_filter"]
    fragment = "\n".join(line for line in fragment.splitlines() if not line.startswith("--"))
    fragment = re.sub(r"\$(\d+)(::[a-z]+(\[\])?)?", lambda m: ARGUMENTS[int(m.group(1)) - 1], fragment)
    schema = render(read_text("schema.sql"), "stepstone")
    for function in ("find_instances", "count_instances", "probe_listing"):
        assert f"WHERE {_plain(fragment)}" in _plain(_body(schema, function)), function


def test_the_probe_listing_states_the_flags_of_probe_columns() -> None:
    columns = named_queries("operations.sql", "stepstone")["probe_columns"]
    columns = re.sub(r"--[^\n]*", "", columns)  # a composed fragment's comments, also after an AND
    body = _body(render(read_text("schema.sql"), "stepstone"), "probe_listing")
    assert f"SELECT {_plain(columns)} FROM" in _plain(body)


def _body(schema: str, function: str) -> str:
    body = schema[schema.index(f'CREATE FUNCTION "stepstone".{function}('):]
    return body[:body.index("END $$;")]
