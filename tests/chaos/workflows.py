"""The rig's workflows, every handler recording its effect in a ledger:

  chaos-N        a chain of N (1-5) action steps s1..sN; from N = 3 on, s1 goes to a 50 ms timer (`nap`), then s2
  chaosfan-K     a fork mapping over K (4-8) items, each branch running s1 -> s2 to the join, then s3 on
                 the root; each branch writes only its own key of the shared `done`, so concurrent branch
                 commits rebase and none is lost (the checker reads `done` back)
  chaosparent-1  s1, then the child step s2 starting a `chaos-2` child and waiting for it, then s3
  chaoshold-1    the same with a `chaossig-2` child, which waits twice for the signal `go`: s3 keeps the child's
                 `got` (tests/ops/test_ops_under_kills.py sweeps live trees; the scenarios never start it)
  chaossaga-3    s1, s2 (each with a compensation that records its own effect), then s3 fails for good: the
                 saga compensates s2, then s1 (test_saga_kills.py; the scenarios' workload never starts it)
  chaossig-2     s1, a wait for the signal `go` (-> s2), another (-> s3): each of s2 and s3 appends the
                 signal's `n` to `got` (test_signal_kills.py sends every signal twice with one dedup key,
                 often before its wait is open; the scenarios' workload never starts it)
  chaosquorum-3  a fork of branches a, b and c, each running s1 to a join that needs two of them, then s2 on
                 the root; the branches named in the state's `fail` raise in s1 on its only attempt
                 (test_branch_failure_kills.py; the scenarios' workload never starts it)
  chaosdue-3     s1 (compensated by undo_s1), s2 with a step deadline (on_deadline -> late), late, s3; s2 and
                 s3 linger for the state's `slow2` / `slow3` seconds after their effect, so that step and instance
                 deadlines fire while handlers run (test_deadline_kills.py; the scenarios never start it)
  chaoskill-3    a fork of branches boom, a and b to a join that needs two of them, then s2 on the root: boom's
                 s1 kills its worker's process (os._exit) every time it runs, a's and b's s1 complete
                 (test_crash_kills.py; the scenarios' workload never starts it)
  chaosext-1     s1, the external step `charge` on topic `chaos.ext` (an outside worker completes it with
                 `charge`), then s2, which checks the variable arrived (test_external_kills.py)
  chaosmove-2    versions 1 and 2: s1, a wait for the signal `go` (-> s2), s2; version 2 runs s3 after s2 and
                 its state needs the `currency` only a migration's state transform gives; each step appends
                 `v<version>:<step>` to `ran` (test_migration_kills.py migrates instances from 1 to 2 while
                 workers die; the scenarios never start it)
  chaosgather-3  s1, then a wait for the signal `go` (-> s2), s2 appends the signal's `n` to `got` and
                 waits again until it holds three, then s3 (test_start_or_signal_kills.py starts and signals
                 it by business key with start_or_signal; the scenarios never start it)
  chaostask-1    a human task (group `chaos`, decision `approve` -> s1), s1, a wait for the message
                 `chaos.receipt` correlated by the state's `key`, then s2 (the rig's driver completes the tasks
                 and publishes the messages while the workers are killed, paused or cut off)
  chaoshand-1    s1, a wait for the message `chaos.receipt` by the state's `key` or the signal `go` (-> s2), s2
                 records which came: a `go` sent before the wait opens wins over a buffered message the wait
                 took, which goes on to another wait of its key (test_task_kills.py; the scenarios never start it)

  chaoskin-3 and its child chaosleg-2: sagas of a parent and its child (tests/chaos/family.py)

Each handler records its effect in the rig's ledger (tests/chaos/ledger.py).
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field

from stepstone.authoring.workflow import CompensationContext, Registry, Retry, StepContext, Workflow
from tests.chaos.family import KIN, LEG
from tests.chaos.ledger import LEDGER, LEDGER_DDL, PAUSE_ENV, configure, record_effect  # noqa: F401 - read here

MAX_STEPS = 5
MAX_CLAIMS_ENV = "CHAOS_MAX_CLAIMS"
"""The workers' `max_claims` (worker_proc; the engine's default when unset)."""
BOOM_EXIT = 17
"""The exit status of a process that chaoskill-3's boom branch killed."""


class Chain(BaseModel):
    n: int = 0


class Fan(BaseModel):
    items: list[int] = Field(default_factory=list)
    done: dict[str, int] = Field(default_factory=dict)


class Ticket(BaseModel):
    key: str = ""
    got: str = ""


class Signalled(BaseModel):
    got: list[int] = Field(default_factory=list)


class Parent(BaseModel):
    n: int = 0
    child_id: str | None = None
    got: list[int] = Field(default_factory=list)  # the child's `got` (a chaossig-2 child's signals)


FAN_ITEMS = (4, 8)  # a fan-out maps over this many items (inclusive range)
FAN_BRANCH_STEPS = 2  # s1, s2 in every branch; s3 after the join
PARENT_CHILD = "chaos-2"




def emits(step: str) -> bool:
    """Odd steps emit an outbox event, even ones do not: a step without events has no outbox row whose
    unique event id would also refuse a second commit, so the fence alone must protect it."""
    return int(step[1:]) % 2 == 1


NAP = timedelta(milliseconds=50)


def _chain(length: int) -> Workflow[Chain]:
    """s1 .. s<length>; a chain of three or more naps on a short timer between s1 and s2, so that kills,
    pauses and restarts also hit a step ending in a timed wait (its command becomes the timer,
    migration 0035) and that timer firing. chaos-2 goes on at once: tests/ops counts the RETRY
    command its s1 runs on, which a nap would turn into the timer."""
    wf: Workflow[Chain] = Workflow(f"chaos-{length}", version=1, state=Chain)
    naps = length > 2
    if naps:
        wf.timer("nap", delay=NAP, next="s2")
    for i in range(1, length + 1):
        nxt = f"s{i + 1}" if i < length else None
        if i == 1 and naps:
            nxt = "nap"

        async def handler(ctx: StepContext, state: Chain) -> None:
            await _effect(ctx)
            state.n += 1

        wf.step(handler, name=f"s{i}", start=i == 1, next=nxt, retry=_RETRY)
    return wf


async def _effect(ctx: StepContext | CompensationContext) -> None:
    """The rig's step body: the effect, the linger a kill or pause hits, the odd steps' event."""
    await record_effect(ctx)
    pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
    if pause > 0:
        await asyncio.sleep(pause)  # simulated work after the effect
    if emits(ctx.step):
        ctx.emit("chaos.step", {"key": ctx.idempotency_key}, key=ctx.instance_id)


_RETRY = Retry(max_attempts=10, backoff=0.2)


def _fan(items: int) -> Workflow[Fan]:
    wf: Workflow[Fan] = Workflow(f"chaosfan-{items}", version=1, state=Fan)
    wf.fork("fan", map_over="items", branch="s1", start=True)

    async def s1(ctx: StepContext, state: Fan) -> None:
        await _effect(ctx)
        assert ctx.branch is not None
        state.done[ctx.branch.name] = 1  # only this branch's key: disjoint from every other branch's change

    async def s2(ctx: StepContext, state: Fan) -> None:
        await _effect(ctx)
        assert ctx.branch is not None
        state.done[ctx.branch.name] += 1

    async def s3(ctx: StepContext, state: Fan) -> None:
        await _effect(ctx)

    wf.step(s1, name="s1", next="s2", retry=_RETRY)
    wf.step(s2, name="s2", next="joined", retry=_RETRY)
    wf.join("joined", fork="fan", next="s3")
    wf.step(s3, name="s3", next=None, retry=_RETRY)
    return wf


def _parent(definition_id: str = "chaosparent-1", child: str = PARENT_CHILD) -> Workflow[Parent]:
    wf: Workflow[Parent] = Workflow(definition_id, version=1, state=Parent)

    async def s1(ctx: StepContext, state: Parent) -> None:
        await _effect(ctx)
        state.n += 1

    async def s2(ctx: StepContext, state: Parent) -> dict[str, Any]:
        await _effect(ctx)
        return {}

    async def s3(ctx: StepContext, state: Parent) -> None:
        await _effect(ctx)
        assert ctx.child is not None and ctx.child.status == "COMPLETED", ctx.child
        state.child_id = ctx.child.instance_id
        state.got = list(ctx.child.state.get("got") or [])

    wf.step(s1, name="s1", start=True, next="s2", retry=_RETRY)
    wf.child(s2, name="s2", workflow=child, next="s3")
    wf.step(s3, name="s3", next=None, retry=_RETRY)
    return wf


class SagaFails(Exception):
    """s3 of the saga: never retried, so the saga compensates."""


class Saga(BaseModel):
    undone: list[str] = Field(default_factory=list)


def _saga() -> Workflow[Saga]:
    wf: Workflow[Saga] = Workflow("chaossaga-3", version=1, state=Saga)

    async def step(ctx: StepContext, state: Saga) -> None:
        await record_effect(ctx)  # no linger here: the kills are meant for the compensations

    async def s3(ctx: StepContext, state: Saga) -> None:
        raise SagaFails("payment refused")

    async def undo(ctx: CompensationContext, state: Saga, recorded: Any) -> None:
        await record_effect(ctx)  # key: instance/compensate/record, the compensation's idempotency key
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause > 0:
            await asyncio.sleep(pause)  # the window a kill hits, after the effect and before the commit
        state.undone.append(ctx.step)

    wf.step(step, name="s1", start=True, next="s2", retry=_RETRY)
    wf.step(step, name="s2", next="s3", retry=_RETRY)
    wf.step(s3, name="s3", next=None, retry=Retry(max_attempts=1))
    wf.compensation("s1", retry=_RETRY, name="undo_s1")(undo)
    wf.compensation("s2", retry=_RETRY, name="undo_s2")(undo)
    return wf


GO = "go"


def _signalled() -> Workflow[Signalled]:
    wf: Workflow[Signalled] = Workflow("chaossig-2", version=1, state=Signalled)

    async def s1(ctx: StepContext, state: Signalled) -> None:
        await _effect(ctx)

    async def took(ctx: StepContext, state: Signalled) -> None:
        await _effect(ctx)
        assert ctx.signal is not None and ctx.signal.name == GO, ctx.signal
        state.got.append(int((ctx.signal.payload or {})["n"]))

    wf.step(s1, name="s1", start=True, next="w1", retry=_RETRY)
    wf.wait("w1", signals={GO: "s2"})
    wf.step(took, name="s2", next="w2", retry=_RETRY)
    wf.wait("w2", signals={GO: "s3"})
    wf.step(took, name="s3", next=None, retry=_RETRY)
    return wf


class Quorum(BaseModel):
    fail: list[str] = Field(default_factory=list)
    done: dict[str, int] = Field(default_factory=dict)


class BranchRefused(Exception):
    """s1 of a quorum's branch named in `fail`: never retried, so the branch fails for good."""


QUORUM_NEED = 2


def _quorum() -> Workflow[Quorum]:
    wf: Workflow[Quorum] = Workflow("chaosquorum-3", version=1, state=Quorum)
    wf.fork("vote", branches={"a": "s1", "b": "s1", "c": "s1"}, start=True)

    async def s1(ctx: StepContext, state: Quorum) -> None:
        await _effect(ctx)
        assert ctx.branch is not None
        if ctx.branch.name in state.fail:
            raise BranchRefused(f"branch {ctx.branch.name} refused")
        state.done[ctx.branch.name] = 1

    async def s2(ctx: StepContext, state: Quorum) -> None:
        await _effect(ctx)

    wf.step(s1, name="s1", next="joined", retry=Retry(max_attempts=1))
    wf.join("joined", fork="vote", next="s2", need=QUORUM_NEED)
    wf.step(s2, name="s2", next=None, retry=_RETRY)
    return wf


TASK_GROUP = "chaos"
RECEIPT = "chaos.receipt"
TASK_STEPS = 2  # s1 and s2 commit a STEP_COMPLETED; the task and the wait are settled by their commands


def _task() -> Workflow[Ticket]:
    wf: Workflow[Ticket] = Workflow("chaostask-1", version=1, state=Ticket)
    wf.task("review", title="Review {key}", decisions={"approve": "s1"}, candidate_groups=[TASK_GROUP],
            start=True)

    async def s1(ctx: StepContext, state: Ticket) -> None:
        await _effect(ctx)

    async def s2(ctx: StepContext, state: Ticket) -> None:
        await _effect(ctx)
        assert ctx.signal is not None and ctx.signal.name == RECEIPT, ctx.signal
        state.got = str((ctx.signal.payload or {}).get("key"))

    wf.step(s1, name="s1", next="receipt", retry=_RETRY)
    wf.wait("receipt", messages={RECEIPT: "s2"}, correlation="key")
    wf.step(s2, name="s2", next=None, retry=_RETRY)
    return wf


class Due(BaseModel):
    slow2: float = 0.0
    slow3: float = 0.0


STEP_DEADLINE = timedelta(seconds=1)


def _due() -> Workflow[Due]:
    wf: Workflow[Due] = Workflow("chaosdue-3", version=1, state=Due)

    async def lingering(ctx: StepContext, seconds: float) -> None:
        await record_effect(ctx)
        if seconds > 0:
            await asyncio.sleep(seconds)  # the handler still runs when a deadline fires

    async def s1(ctx: StepContext, state: Due) -> None:
        await record_effect(ctx)

    async def s2(ctx: StepContext, state: Due) -> None:
        await lingering(ctx, state.slow2)

    async def late(ctx: StepContext, state: Due) -> None:
        await record_effect(ctx)

    async def s3(ctx: StepContext, state: Due) -> None:
        await lingering(ctx, state.slow3)

    async def undo(ctx: CompensationContext, state: Due, recorded: Any) -> None:
        await record_effect(ctx)

    wf.step(s1, name="s1", start=True, next="s2", retry=_RETRY)
    wf.step(s2, name="s2", next="s3", retry=_RETRY, deadline=STEP_DEADLINE, on_deadline="late")
    wf.step(late, name="late", next="s3", retry=_RETRY)
    wf.step(s3, name="s3", next=None, retry=_RETRY)
    wf.compensation("s1", retry=_RETRY, name="undo_s1")(undo)
    return wf


class Charged(BaseModel):
    charge: str = ""


EXT_TOPIC = "chaos.ext"


def _external() -> Workflow[Charged]:
    wf: Workflow[Charged] = Workflow("chaosext-1", version=1, state=Charged)

    async def s1(ctx: StepContext, state: Charged) -> None:
        await _effect(ctx)

    async def s2(ctx: StepContext, state: Charged) -> None:
        await record_effect(ctx)
        assert state.charge.startswith("ch-"), state  # the outside worker's variable arrived

    wf.step(s1, name="s1", start=True, next="charge", retry=_RETRY)
    wf.external("charge", topic=EXT_TOPIC, next="s2", retry=Retry(max_attempts=10, backoff=0.2))
    wf.step(s2, name="s2", next=None, retry=_RETRY)
    return wf


def _kill() -> Workflow[Quorum]:
    wf: Workflow[Quorum] = Workflow("chaoskill-3", version=1, state=Quorum)
    wf.fork("split", branches={"boom": "boom", "a": "s1", "b": "s1"}, start=True)

    async def boom(ctx: StepContext, state: Quorum) -> None:
        await record_effect(ctx)
        await asyncio.sleep(0.2)  # simulated work: the siblings claimed beside it start meanwhile
        os._exit(BOOM_EXIT)  # the process dies with every command it holds, as on a segfault or the OOM killer

    async def s1(ctx: StepContext, state: Quorum) -> None:
        await _effect(ctx)
        assert ctx.branch is not None
        state.done[ctx.branch.name] = 1

    async def s2(ctx: StepContext, state: Quorum) -> None:
        await _effect(ctx)

    wf.step(boom, name="boom", next="joined", retry=_RETRY)
    wf.step(s1, name="s1", next="joined", retry=_RETRY)
    wf.join("joined", fork="split", next="s2", need=2)
    wf.step(s2, name="s2", next=None, retry=_RETRY)
    return wf


class Moving(BaseModel):
    ran: list[str] = Field(default_factory=list)


class MovedOn(Moving):
    currency: str  # no default: only the migration's state transform gives it


def _moving(version: int) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("chaosmove-2", version=version, state=Moving if version == 1 else MovedOn)

    async def ran(ctx: StepContext, state: Moving) -> None:
        await _effect(ctx)
        state.ran.append(f"v{version}:{ctx.step}")

    wf.step(ran, name="s1", start=True, next="w", retry=_RETRY)
    wf.wait("w", signals={GO: "s2"})
    wf.step(ran, name="s2", next="s3" if version == 2 else None, retry=_RETRY)
    if version == 2:
        wf.step(ran, name="s3", next=None, retry=_RETRY)
    return wf


class Gathered(BaseModel):
    got: list[int] = Field(default_factory=list)


GATHER = 3  # signals a chaosgather-3 instance takes before it ends


def _gather() -> Workflow[Gathered]:
    wf: Workflow[Gathered] = Workflow(f"chaosgather-{GATHER}", version=1, state=Gathered)

    async def s1(ctx: StepContext, state: Gathered) -> None:
        await _effect(ctx)

    async def took(ctx: StepContext, state: Gathered) -> str:
        await _effect(ctx)
        assert ctx.signal is not None and ctx.signal.name == GO, ctx.signal
        state.got.append(int((ctx.signal.payload or {})["n"]))
        return "s3" if len(state.got) >= GATHER else "w"

    wf.step(s1, name="s1", start=True, next="w", retry=_RETRY)
    wf.wait("w", signals={GO: "s2"})
    wf.step(took, name="s2", next=["w", "s3"], retry=_RETRY)
    wf.step(s1, name="s3", next=None, retry=_RETRY)
    return wf


def _handed() -> Workflow[Ticket]:
    """A wait for the message RECEIPT by the state's `key`, or the signal GO. Sent GO before its wait opens,
    an instance's wait takes a buffered message and the GO then wins: the message goes on to another wait of
    its key, or back to the buffer (migrations 0074, 0077). `got` is GO, or the message's key."""
    wf: Workflow[Ticket] = Workflow("chaoshand-1", version=1, state=Ticket)

    async def s1(ctx: StepContext, state: Ticket) -> None:
        await _effect(ctx)

    async def took(ctx: StepContext, state: Ticket) -> None:
        await _effect(ctx)
        assert ctx.signal is not None, ctx
        state.got = GO if ctx.signal.name == GO else str((ctx.signal.payload or {}).get("key"))

    wf.step(s1, name="s1", start=True, next="w", retry=_RETRY)
    wf.wait("w", messages={RECEIPT: "s2"}, signals={GO: "s2"}, correlation="key")
    wf.step(took, name="s2", next=None, retry=_RETRY)
    return wf


CHAINS: dict[int, Workflow[Any]] = {n: _chain(n) for n in range(1, MAX_STEPS + 1)}
FANS: dict[int, Workflow[Any]] = {k: _fan(k) for k in range(FAN_ITEMS[0], FAN_ITEMS[1] + 1)}
PARENT: Workflow[Any] = _parent()
HOLDER: Workflow[Any] = _parent("chaoshold-1", "chaossig-2")
SAGA: Workflow[Any] = _saga()
TASK: Workflow[Any] = _task()
SIGNALLED: Workflow[Any] = _signalled()
QUORUM: Workflow[Any] = _quorum()
DUE: Workflow[Any] = _due()
EXTERNAL: Workflow[Any] = _external()
KILL: Workflow[Any] = _kill()
MOVING: Workflow[Any] = _moving(1)
MOVED: Workflow[Any] = _moving(2)
GATHERING: Workflow[Any] = _gather()
HANDED: Workflow[Any] = _handed()
registry = Registry(*CHAINS.values(), *FANS.values(), PARENT, HOLDER, SAGA, TASK, SIGNALLED, QUORUM, DUE, EXTERNAL,
                    KILL, MOVING, MOVED, GATHERING, HANDED, KIN, LEG)

SERVED_PARTS = ("all", "chains", "rest", "moving", "moved")
"""What one worker of the rig serves (`worker_proc --serve`): every workflow, the chains alone, or every
other workflow (with the chain the parent starts as its child, which its registry must hold). The fleet
splits its slots between them so that claims of workers serving some workflows run under every fault.
`moving` and `moved` are the two releases of a rolling deploy, version 1 and version 2 of chaosmove-2 alone
(test_rolling_deploy_kills.py gives them slots of their own)."""


def served(part: str) -> Registry:
    if part == "chains":
        return Registry(*CHAINS.values())
    if part in ("moving", "moved"):
        return Registry(MOVING if part == "moving" else MOVED)
    if part == "rest":
        return Registry(*FANS.values(), PARENT, HOLDER, SAGA, TASK, SIGNALLED, QUORUM, DUE, EXTERNAL, KILL, MOVING,
                        MOVED, GATHERING, HANDED, KIN, LEG, *(wf for wf in CHAINS.values() if wf.id == PARENT_CHILD))
    return registry
