"""Model-based test of the store's command and instance state machines (Hypothesis RuleBasedStateMachine).

Rules: start (with idempotency keys), signal (with dedup keys), claim, renew, commit (success or failure),
lease expiry (moving the database clock), a takeover (expiry, then another worker claims and commits at
once), commit under a stale token, cancel and retry, all against the
real store. Three workflows: a chain with a wait, and two forks of two static branches (`l`, `r`) whose
join needs all of them or any one (the loser is cancelled), so claims and commits happen on branch
positions and on the root at once. Every step writes its own position's key of the shared state, so
commits of different positions race on the state version. A small model predicts which token holds
each (instance, position) (so which commits and renewals must be refused), which positions failed and
which dedup keys were used. After every rule the invariants are read from the database:

  at most one CLAIMED command per position, and it carries the position's lease token
  a commit under a stale token is fenced, never answered with a state conflict
  a closed (COMPLETED or CANCELLED) position has no PENDING or CLAIMED command
  instances.branches is the number of live (not closed) non-root positions
  tokens are never reused
  terminal statuses (COMPLETED, CANCELLED) never change
  a dedup key is recorded once and applied at most once
  history seq is gapless per instance (1..n, n = instances.history_seq)

One database per test function; tables are truncated between examples.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.client import Client
from stepstone.core.effects import CloseBranches, MovePosition
from stepstone.core.model import CommandView, InstanceView, RunStep, StepFailed, StepSucceeded
from stepstone.core.pin import pin_of
from stepstone.core.transitions import advance, apply, complete_step
from stepstone.errors import IdempotencyConflict, InvalidState
from stepstone.store.port import Claim, CommitRequest, Pin
from stepstone.store.postgres import PostgresStore

LEASE = 5.0

wf: Workflow[Any] = Workflow("model", version=1)


@wf.step(start=True, next="w")
def a(ctx: StepContext, state: dict[str, Any]) -> None:
    """Never called: the model decides each handler's outcome."""


wf.wait("w", signals={"go": "b"})


@wf.step(next=None)
def b(ctx: StepContext, state: dict[str, Any]) -> None:
    """Never called either."""




def _forked(need: str) -> Workflow[Any]:
    """fork f {l: l1, r: r1} -> join j (need) -> wait w (go) -> b: handlers never called either."""
    fw: Workflow[Any] = Workflow(f"model-fork-{need}", version=1)
    fw.fork("f", branches={"l": "l1", "r": "r1"}, start=True)

    def never(ctx: StepContext, state: dict[str, Any]) -> None:
        """The model decides."""

    for name, nxt in (("l1", "j"), ("r1", "j"), ("b", None)):
        fw.step(never, name=name, next=nxt)
    fw.join("j", fork="f", next="w", need=need)
    fw.wait("w", signals={"go": "b"})
    return fw


FORKS = (_forked("all"), _forked("any"))
registry = Registry(wf, *FORKS)


@dataclass
class Held:
    """A claim as a worker keeps it: the live command, the instance as this worker last saw it."""

    instance: InstanceView
    command: CommandView
    pin: Pin
    token: Any
    now: datetime
    spent: bool = False


class Runner:
    """One event loop, one store and one client for every example of a test function."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.store: PostgresStore = self.run(PostgresStore.open(url, max_size=4))
        self.client = Client(self.store, registry)
        for w in registry:
            self.run(self.store.register(pin_of(w), w.plan.document()))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def reset(self) -> None:
        self.run(self.store.pool.execute(
            "TRUNCATE stepstone.instances, stepstone.positions, stepstone.commands, stepstone.dedup, "
            "stepstone.history, stepstone.outbox; UPDATE stepstone.clock SET offset_by = '0'"))

    def close(self) -> None:
        self.run(self.store.close())
        self.loop.close()


class StoreMachine(RuleBasedStateMachine):
    runner: Runner

    instances = Bundle("instances")
    claims = Bundle("claims")

    def __init__(self) -> None:
        super().__init__()
        self.r = self.runner
        self.r.reset()
        self.holder: dict[tuple[str, str], Any] = {}  # position -> the token that may write it (None: nobody)
        self.tokens: set[Any] = set()
        self.by_key: dict[str, str] = {}
        self.dedup: dict[tuple[str, str], tuple[int, Any]] = {}
        self.ended: dict[str, str] = {}
        self.failed: set[tuple[str, str]] = set()  # failed positions; an instance is FAILED while it has one
        self.writes = 0

    # -- rules ------------------------------------------------------------------------------

    def _failed(self, iid: str) -> bool:
        return any(i == iid for i, _ in self.failed)

    @rule(target=instances, key=st.sampled_from([None, "k1", "k2"]), which=st.sampled_from([0, 1, 2]))
    def start(self, key: str | None, which: int) -> Any:
        flow = (wf, *FORKS)[which]
        iid = self.r.run(self.r.client.start(flow, {}, idempotency_key=None if key is None else f"{key}-{which}"))
        key = None if key is None else f"{key}-{which}"
        if key is not None and key in self.by_key:
            assert iid == self.by_key[key], "a repeated start key made a second instance"
            return iid  # the same instance enters the bundle again
        if key is not None:
            self.by_key[key] = iid
        self.holder[(iid, "")] = None
        return iid

    @rule(iid=instances, key=st.sampled_from([None, "d1", "d2"]), payload=st.sampled_from([1, 2]))
    def signal(self, iid: str, key: str | None, payload: int) -> None:
        prior = self.dedup.get((iid, key)) if key else None
        try:
            cid = self.r.run(self.r.client.signal(iid, "go", payload, dedup_key=key))
        except IdempotencyConflict:
            assert prior is not None and prior[1] != payload
            return
        except InvalidState:
            assert prior is None and iid in self.ended
            return
        if prior is not None:
            assert prior[1] == payload and cid == prior[0], "a dedup key applied twice"
        elif key is not None:
            self.dedup[(iid, key)] = (cid, payload)

    @rule(target=claims, n=st.integers(1, 3))
    def claim(self, n: int) -> Any:
        got = self.r.run(self.r.store.claim(n, LEASE, "model"))
        out = []
        for c in got:
            assert c.token not in self.tokens, "a token was issued twice"
            self.tokens.add(c.token)
            self.holder[(c.instance.id, c.instance.position)] = c.token
            out.append(Held(c.instance, c.command, c.pin, c.token, c.now))
        return out

    @rule(batch=claims)
    def renew(self, batch: list[Held]) -> None:
        for h in batch:
            key = (h.instance.id, h.instance.position)
            kept = self.r.run(self.r.store.renew({key: h.token}, LEASE))
            assert (key in kept) == (self.holder.get(key) == h.token)

    @rule(batch=claims, fail=st.booleans())
    def commit(self, batch: list[Held], fail: bool) -> None:
        for h in batch:
            if h.spent:
                continue
            self._commit(h, fail)

    def _commit(self, h: Held, fail: bool) -> None:
        iid = h.instance.id
        plan = registry.find(h.pin.definition_id, h.pin.version, h.pin.plan_hash).plan  # type: ignore[union-attr]
        outcome = apply(h.instance, h.command, plan, h.now, 5)
        visit = h.instance.visit
        if isinstance(outcome, RunStep):
            self.writes += 1  # this position's own key of the shared state: positions never overlap
            mine = {**h.instance.state, (h.instance.position or "root").replace("/", "."): self.writes}
            result = StepFailed("Boom", "model failure", retryable=False) if fail else StepSucceeded(None, mine)
            decision = complete_step(h.instance, h.command, plan, result, h.now)
            visit = outcome.visit
        else:
            decision = outcome
        claim = Claim(h.instance, h.command, h.pin, h.token, h.now)
        key = (iid, h.instance.position)
        expected = self.holder.get(key) == h.token
        request = CommitRequest(claim, h.command.id, decision, visit, h.instance.state_version)
        committed = self.r.run(self.r.store.commit(request, lease_seconds=LEASE, worker="model"))
        if committed is not None:
            # Positions write their own keys: the commit carries each onto the newer state, never refuses.
            assert not committed.conflict, "changes of different positions' keys must merge in the commit"
        assert (committed is not None) == expected, (
            f"commit {'applied' if committed else 'refused'} but the model says the token "
            f"{'holds' if expected else 'is stale'}")
        if committed is None:
            h.spent = True
            return
        self._committed(h, key, decision, committed)

    def _committed(self, h: Held, key: tuple[str, str], decision: Any, committed: Any) -> None:
        """The model after a commit that applied."""
        iid = h.instance.id
        follow = decision.continuation
        move = decision.first(MovePosition)
        if decision.ended:
            self.ended[iid] = "COMPLETED"
        if move is not None:
            if move.status == "FAILED":
                self.failed.add(key)
            else:
                self.failed.discard(key)
        for closed in decision.of(CloseBranches):  # a join's losers: cancelled, their leases gone
            for k in [k for k in self.holder if k[0] == iid and k[1].startswith(closed.prefix)]:
                self.holder[k] = None
            self.failed -= {k for k in self.failed if k[0] == iid and k[1].startswith(closed.prefix)}
        if follow is not None and committed.continuation is not None:
            h.instance = advance(h.instance, decision, committed.state_version)
            if committed.state is not None:  # merged onto a newer state: go on from what it left
                h.instance = replace(h.instance, state=committed.state)
            h.command = CommandView(committed.continuation, "STEP", follow.step, follow.visit, None, follow.payload)
            h.now = committed.committed_at
        else:
            h.spent = True
            self.holder[key] = None

    @rule(target=claims)
    def take_over(self) -> Any:
        """Every lease expires and another worker claims and commits at once: whoever held those
        positions before is a zombie now, behind a newer state version."""
        self.r.run(self.r.store.move_clock(LEASE + 1))
        batch = self.claim(3)
        for h in batch:
            self._commit(h, fail=False)
        return batch

    @rule()
    def expire_leases(self) -> None:
        self.r.run(self.r.store.move_clock(LEASE + 1))

    @rule(iid=instances)
    def cancel(self, iid: str) -> None:
        status = self.r.run(self.r.client.cancel(iid, "model"))
        if iid in self.ended:
            assert status == self.ended[iid], "cancel changed a terminal instance"
            return
        assert status == "CANCELLED"
        self.ended[iid] = "CANCELLED"
        self.failed -= {k for k in self.failed if k[0] == iid}
        for key in [k for k in self.holder if k[0] == iid]:
            self.holder[key] = None

    @rule(iid=instances)
    def retry(self, iid: str) -> None:
        try:
            self.r.run(self.r.client.retry(iid))
        except InvalidState:
            assert not self._failed(iid)
            return
        assert self._failed(iid), "retry applied to an instance that was not FAILED"
        self.failed -= {k for k in self.failed if k[0] == iid}

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def database_invariants(self) -> None:
        fetch = self.r.store.pool.fetch
        two = self.r.run(fetch(
            "SELECT c.instance_id, c.position, count(*) AS n "
            "FROM stepstone.commands c LEFT JOIN stepstone.positions p "
            "  ON p.instance_id = c.instance_id AND p.path = c.position "
            "WHERE c.state = 'CLAIMED' GROUP BY c.instance_id, c.position HAVING count(*) > 1 OR NOT bool_and("
            "c.token IS NOT DISTINCT FROM p.lease_token)"))
        assert not two, f"live claims per position: {[dict(r) for r in two]}"
        closed = self.r.run(fetch(
            "SELECT c.instance_id, c.position, p.status, c.id, c.kind, c.state FROM stepstone.commands c "
            "JOIN stepstone.positions p ON p.instance_id = c.instance_id AND p.path = c.position "
            "WHERE p.status IN ('COMPLETED', 'CANCELLED') AND c.state IN ('PENDING', 'CLAIMED')"))
        assert not closed, f"open commands on closed positions: {[dict(r) for r in closed]}"
        branches = self.r.run(fetch(
            "SELECT i.id, i.branches, (SELECT count(*) FROM stepstone.positions p WHERE p.instance_id = i.id "
            "  AND p.path <> '' AND p.status NOT IN ('COMPLETED', 'CANCELLED')) AS live "
            "FROM stepstone.instances i"))
        wrong = [dict(r) for r in branches if r["branches"] != r["live"]]
        assert not wrong, f"instances.branches is not the number of live branches: {wrong}"
        for iid, status in self.ended.items():
            now = self.r.run(self.r.store.status(iid))
            assert now == status, f"terminal instance {iid} went from {status} to {now}"
        dups = self.r.run(fetch(
            "SELECT instance_id, dedup_key FROM stepstone.commands WHERE kind = 'SIGNAL' AND dedup_key IS NOT NULL "
            "GROUP BY 1, 2 HAVING count(*) > 1"))
        assert not dups, f"a dedup key recorded twice: {[dict(r) for r in dups]}"
        applied = self.r.run(fetch(
            "SELECT data->>'command' AS cmd FROM stepstone.history WHERE kind = 'SIGNAL_APPLIED' "
            "GROUP BY 1 HAVING count(*) > 1"))
        assert not applied, f"a signal applied twice: {[dict(r) for r in applied]}"
        gaps = self.r.run(fetch(
            "SELECT i.id FROM stepstone.instances i LEFT JOIN stepstone.history h ON h.instance_id = i.id "
            "GROUP BY i.id, i.history_seq "
            "HAVING count(h.*) <> i.history_seq OR coalesce(min(h.seq), 1) <> 1 "
            "    OR coalesce(max(h.seq), 0) <> i.history_seq"))
        assert not gaps, f"history seq not gapless: {[dict(r) for r in gaps]}"
        tokens = self.r.run(self.r.store.pool.fetchval(
            "SELECT count(*) FROM (SELECT token FROM stepstone.commands WHERE token IS NOT NULL "
            "GROUP BY token HAVING count(DISTINCT id) > 1 AND count(*) FILTER (WHERE state = 'CLAIMED') > 1) t"))
        assert tokens == 0, "one token claims two live commands"


@pytest.mark.parametrize("seed", [0])
def test_store_state_machine(database_url: str, seed: int) -> None:
    runner = Runner(database_url)
    StoreMachine.runner = runner
    try:
        run_state_machine_as_test(
            StoreMachine,
            settings=settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
        )
    finally:
        runner.close()
