"""The operations' list and counts run in functions (migration 0064: find_instances, count_instances) that
state operations.sql's `instance_filter` again, so that each is planned with its arguments; the stuck
report and the probe compose the fragment. Both must mean the same."""

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
    for function in ("find_instances", "count_instances"):
        body = schema[schema.index(f'CREATE FUNCTION "stepstone".{function}('):]
        body = body[:body.index("END $$;")]
        assert f"WHERE {_plain(fragment)}" in _plain(body), function
