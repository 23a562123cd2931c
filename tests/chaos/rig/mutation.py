"""The mutation the zombie checker must catch: the store's commit function with its fence removed.

The fence of `commit_decision` is the position's token (checked before a state conflict is reported,
before a step's commit after its step deadline interrupts the step, before a commit that would end the
instance after its deadline times it out, when a command leaving a wait after its deadline gives the
position's lease back, and again when the position is moved) and the command's (settled, taken over by a
continuation, turned into the wait's timer, or settled as one that came after its wait's deadline, only
while CLAIMED under that token); a segment that ran a version the
instance was migrated from gives its claim back under both tokens too. Each predicate is replaced by one
without the token. Each anchor must be found as many times as listed; when it is not (the commit
changed), the mutation raises instead of silently mutating nothing or only part of the fence.
"""

from __future__ import annotations

from stepstone.store.sqlfiles import SCHEMA_PLACEHOLDER, read_text, render

__all__ = ["FENCE", "MutationAnchorGone", "unfenced", "unfenced_commit_segment"]

COMMIT_FUNCTION = "commit_decision"

FENCE = (
    ("p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token",
     "p.instance_id = v_id AND p.path = v_pos", 6),
    ("WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE", "WHERE c.id = v_cmd", 5),
)


class MutationAnchorGone(RuntimeError):
    """An anchor of the fence is not in the commit function: the mutation check would test nothing."""


def unfenced(function_sql: str) -> str:
    """`function_sql` (one CREATE FUNCTION) without its fence."""
    body = function_sql
    for old, new, times in FENCE:
        if body.count(old) != times:
            raise MutationAnchorGone(f"the fence moved: {old!r} is not in {COMMIT_FUNCTION} {times} time(s)")
        body = body.replace(old, new)
    if not body.startswith("CREATE OR REPLACE FUNCTION"):
        body = body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    return body


def unfenced_commit_segment(schema: str = "stepstone") -> str:
    """The commit function from schema.sql (its last definition: a later version replaces it) with its
    fence predicates removed, rendered for `schema`."""
    text = read_text("schema.sql")
    name = f"FUNCTION {SCHEMA_PLACEHOLDER}.{COMMIT_FUNCTION}("
    found = text.rfind(name)
    if found < 0:
        raise MutationAnchorGone(f"schema.sql defines no function {COMMIT_FUNCTION}")
    start = text.rindex("CREATE", 0, found)
    end = text.index("END $$;", start) + len("END $$;")
    return render(unfenced(text[start:end]), schema)
