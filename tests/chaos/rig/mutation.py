"""The mutation the zombie checker must catch: the store's commit function with its fence removed.

The fence of `commit_decision` is two predicates: the position row is moved only while it holds
the claim's token, and the command is settled only while it is CLAIMED under that token. Each is
replaced by a predicate without the token. Each anchor must be found exactly once; when one is
not (the commit changed), the mutation raises instead of silently mutating nothing.
"""

from __future__ import annotations

from stepstone.store.sqlfiles import SCHEMA_PLACEHOLDER, read_text, render

__all__ = ["FENCE", "MutationAnchorGone", "unfenced", "unfenced_commit_segment"]

COMMIT_FUNCTION = "commit_decision"

FENCE = (
    ("WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token",
     "WHERE p.instance_id = v_id AND p.path = v_pos"),
    ("WHERE c.id = v_cmd AND c.token = v_token AND c.state = 'CLAIMED'", "WHERE c.id = v_cmd"),
)


class MutationAnchorGone(RuntimeError):
    """An anchor of the fence is not in the commit function: the mutation check would test nothing."""


def unfenced(function_sql: str) -> str:
    """`function_sql` (one CREATE FUNCTION) without its fence."""
    body = function_sql
    for old, new in FENCE:
        if body.count(old) != 1:
            raise MutationAnchorGone(f"the fence moved: {old!r} is not in {COMMIT_FUNCTION} exactly once")
        body = body.replace(old, new)
    return body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def unfenced_commit_segment(schema: str = "stepstone") -> str:
    """The commit function from schema.sql with its fence predicates removed, rendered for `schema`."""
    text = read_text("schema.sql")
    start = text.find(f"CREATE FUNCTION {SCHEMA_PLACEHOLDER}.{COMMIT_FUNCTION}(")
    if start < 0:
        raise MutationAnchorGone(f"schema.sql defines no function {COMMIT_FUNCTION}")
    end = text.index("END $$;", start) + len("END $$;")
    return render(unfenced(text[start:end]), schema)
