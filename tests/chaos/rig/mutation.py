"""The mutation the zombie checker must catch: the store's commit function with its fence removed.

The anchor is found by a rule, not a literal: the function is the one the store's `commit` named
query calls, its fence is every comparison with its token parameter (a uuid parameter whose name
says token), together with the claimed-state check joined to it. Each is replaced by `true`. When
the rule finds nothing to remove, the mutation raises instead of silently mutating nothing.
"""

from __future__ import annotations

import re

from stepstone.store.queries import queries
from stepstone.store.sqlfiles import SCHEMA_PLACEHOLDER, read_text, render

__all__ = ["MutationAnchorGone", "commit_function_name", "unfenced", "unfenced_commit_segment"]


class MutationAnchorGone(RuntimeError):
    """The rule found no fence to remove: the mutation check would test nothing."""


def commit_function_name(schema: str = "stepstone") -> str:
    """The server-side function the store's one-commit statement calls."""
    found = re.findall(r'"?' + re.escape(schema) + r'"?\.(\w+)\s*\(', queries(schema)["commit"])
    if len(found) != 1:
        raise MutationAnchorGone(f"the commit query calls {found or 'no function'}; expected exactly one")
    return found[0]


def unfenced(function_sql: str) -> tuple[str, int]:
    """`function_sql` (one CREATE FUNCTION) without its fence, and how many predicates were removed."""
    head = function_sql[: function_sql.index(")")]
    tokens = re.findall(r"(\w*token\w*)\s+uuid", head)
    if not tokens:
        raise MutationAnchorGone("the commit function takes no uuid token parameter")
    removed = 0
    body = function_sql
    for param in tokens:
        fence = re.compile(
            r"\b(?:\w+\.)?\w*token\s*=\s*" + re.escape(param) + r"\b(?:\s+AND\s+(?:\w+\.)?state\s*=\s*'CLAIMED')?"
        )
        body, n = fence.subn("true", body)
        removed += n
    if removed == 0:
        raise MutationAnchorGone(f"no predicate compares with {', '.join(tokens)}: the fence moved")
    return body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1), removed


def unfenced_commit_segment(schema: str = "stepstone") -> str:
    """The commit function from schema.sql with its fence predicates removed, rendered for `schema`."""
    text = read_text("schema.sql")
    name = commit_function_name(schema)
    start = text.find(f"CREATE FUNCTION {SCHEMA_PLACEHOLDER}.{name}(")
    if start < 0:
        raise MutationAnchorGone(f"schema.sql defines no function {name}")
    end = text.index("END $$;", start) + len("END $$;")
    body, _ = unfenced(text[start:end])
    return render(body, schema)
