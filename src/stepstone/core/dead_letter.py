"""When a command that keeps ending its claims without a commit is dead-lettered.

A claim ends without a commit when its worker's process dies (os._exit, a segfault, the OOM killer):
every command that worker held is claimed again. Which of them killed the process cannot be told from
that one crash, so a command claimed again runs alone in its worker (`runtime/alone.py`), and a crash
counts on a command only by the claims in which it ran alone: it is dead-lettered once `max_claims` of
its claims ran alone and none committed. A sibling that shared one crash with the command that caused
it pays nothing for it; the cause is dead-lettered after its first crash and `max_claims` alone.
"""

from __future__ import annotations

from stepstone.core.model import CommandView


def dead_lettered(command: CommandView, max_claims: int) -> bool:
    """Whether the claimed command has run alone, without a commit, `max_claims` times."""
    return command.alone_claims >= max_claims


def claims_spent(command: CommandView, max_claims: int) -> str:
    """The dead letter's reason, after ATTEMPTS_EXHAUSTED (and the last error the command recorded)."""
    reason = (f"claimed {command.claims - 1} times without a commit, {command.alone_claims} of them alone "
              f"in its worker (limit {max_claims})")
    return reason + (f"; last error: {command.last_error}" if command.last_error else "")
