"""Saga workflows the saga tests run, steered per instance through module-level dicts.

`FAIL` makes a step or a compensation raise: `FAIL[(instance, name)] = n` raises n more times
(-1: always). `HOLD` makes `slow_step` wait inside its handler until the test releases it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import CompensationContext, Registry, Retry, StepContext, Workflow


class Trip(BaseModel):
    trip: str = "t"
    log: list[str] = []
    undone: list[str] = []


class Boom(Exception):
    """A retryable error."""


class Declined(Exception):
    """Never retried."""


FAIL: dict[tuple[str, str], int] = {}
HOLD: dict[str, asyncio.Event] = {}
ENTERED: dict[str, asyncio.Event] = {}
CALLS: list[tuple[str, str]] = []
"""(instance, compensation) for every compensation handler call, in call order."""


def _maybe_fail(instance_id: str, name: str) -> None:
    left = FAIL.get((instance_id, name), 0)
    if left == -1:
        raise Boom(f"{name} is down")
    if left > 0:
        FAIL[(instance_id, name)] = left - 1
        raise Boom(f"{name} failed, {left - 1} failures to go")


def _undo(name: str) -> Any:
    def undo(ctx: CompensationContext, state: Trip, recorded: Any) -> None:
        CALLS.append((ctx.instance_id, name))
        _maybe_fail(ctx.instance_id, f"undo_{name}")
        state.undone.append(f"{name}:{recorded}")

    undo.__name__ = f"undo_{name}"
    return undo


QUICK = Retry(max_attempts=3, backoff=0)

# -- linear: one -> two -> three (three may fail) ---------------------------------------------------

linear: Workflow[Trip] = Workflow("linear", version=1, state=Trip)


@linear.step(start=True, next="two")
def one(ctx: StepContext, state: Trip) -> None:
    state.log.append("one")
    ctx.record({"id": "one-1"})


@linear.step(next="three")
async def two(ctx: StepContext, state: Trip) -> None:
    state.log.append("two")
    ctx.record("two-1")


@linear.step(next=None, retry=Retry(max_attempts=1))
def three(ctx: StepContext, state: Trip) -> None:
    _maybe_fail(ctx.instance_id, "three")
    state.log.append("three")


linear.compensation("one", retry=QUICK)(_undo("one"))


@linear.compensation("two", retry=Retry(max_attempts=2, backoff=0))
async def undo_two(ctx: CompensationContext, state: Trip, recorded: Any) -> None:
    CALLS.append((ctx.instance_id, "two"))
    _maybe_fail(ctx.instance_id, "undo_two")
    state.undone.append(f"two:{recorded}")
    ctx.emit("two.undone", {"trip": state.trip})


# -- waits: book -> wait(go) -> finish; a slow step -------------------------------------------------

waiting: Workflow[Trip] = Workflow("waiting", version=1, state=Trip, deadline=3600)


@waiting.step(start=True, next="hold_on")
def book(ctx: StepContext, state: Trip) -> None:
    state.log.append("book")


waiting.compensation("book", retry=QUICK)(_undo("book"))
waiting.wait("hold_on", signals={"go": "slow_step", "done": "finish"})


async def _slow(ctx: StepContext, state: Trip) -> None:
    """Waits in its handler while the test holds it (HOLD), after saying it entered (ENTERED)."""
    entered = ENTERED.get(ctx.instance_id)
    if entered is not None:
        entered.set()
    hold = HOLD.get(ctx.instance_id)
    if hold is not None:
        await hold.wait()
    state.log.append("slow")


waiting.step(_slow, name="slow_step", next="finish")


@waiting.step(next=None)
def finish(ctx: StepContext, state: Trip) -> None:
    state.log.append("finish")


waiting.compensation("slow_step", retry=QUICK)(_undo("slow_step"))

# -- branches: first -> fork(a: step_a, b: step_b) -> join -> last (fails) --------------------------

forked: Workflow[Trip] = Workflow("forked", version=1, state=Trip)


@forked.step(start=True, next="split")
def first(ctx: StepContext, state: Trip) -> None:
    state.log.append("first")


forked.fork("split", branches={"a": "step_a", "b": "step_b"})


@forked.step(next="meet")
async def step_a(ctx: StepContext, state: Trip) -> None:
    hold = HOLD.get(ctx.instance_id)
    if hold is not None:  # the test releases a once b has committed, so b completes first
        await hold.wait()


@forked.step(next="meet")
async def step_b(ctx: StepContext, state: Trip) -> None:
    state.log.append("b")


forked.join("meet", fork="split", next="last")


@forked.step(next=None, retry=Retry(max_attempts=1))
def last(ctx: StepContext, state: Trip) -> None:
    raise Declined("no")


for _name in ("first", "step_a", "step_b"):
    forked.compensation(_name, retry=QUICK)(_undo(_name))

# -- a plain workflow without compensations, for cancel --------------------------------------------

plain: Workflow[Trip] = Workflow("plain", version=1, state=Trip)
plain.fork("spread", branches={"w": "wait_w", "t": "wait_t"}, start=True)
plain.wait("wait_w", signals={"go": "gather"})
plain.wait("wait_t", signals={"go": "gather"}, timeout=600, on_timeout="gather")
plain.join("gather", fork="spread", next="tail")


@plain.step(next=None)
def tail(ctx: StepContext, state: Trip) -> None:
    state.log.append("tail")


# -- children: outbound -> sub (child workflow leg) -> pay (fails) ----------------------------------

leg: Workflow[Trip] = Workflow("leg", version=1, state=Trip)


@leg.step(start=True, next=None)
def leg_book(ctx: StepContext, state: Trip) -> None:
    state.log.append("leg")
    ctx.record("seat-7")


leg.compensation("leg_book", retry=QUICK)(_undo("leg_book"))

trip: Workflow[Trip] = Workflow("trip", version=1, state=Trip)


@trip.step(start=True, next="sub")
def outbound(ctx: StepContext, state: Trip) -> None:
    state.log.append("outbound")


trip.compensation("outbound", retry=QUICK)(_undo("outbound"))


@trip.child(workflow="leg", next="pay")
def sub(ctx: StepContext, state: Trip) -> dict[str, Any]:
    return {"trip": state.trip}


@trip.step(next=None, retry=Retry(max_attempts=1))
def pay(ctx: StepContext, state: Trip) -> None:
    raise Declined("no")


# -- tour: outbound -> sub (child workflow leg) -> settle, which fails while FAIL says so -------------

tour: Workflow[Trip] = Workflow("tour", version=1, state=Trip)
tour.step(outbound, name="outbound", start=True, next="sub")
tour.compensation("outbound", retry=QUICK)(_undo("outbound"))
tour.child(sub, name="sub", workflow="leg", next="settle")


@tour.step(name="settle", next=None, retry=Retry(max_attempts=1))
def tour_settle(ctx: StepContext, state: Trip) -> None:
    _maybe_fail(ctx.instance_id, "settle")
    state.log.append("settle")


# -- step deadlines: begin -> slow (5 s; on_deadline: fallback) -> fallback; strict fails instead ------

timely: Workflow[Trip] = Workflow("timely", version=1, state=Trip)


@timely.step(start=True, next="slow")
def begin(ctx: StepContext, state: Trip) -> None:
    state.log.append("begin")


timely.step(_slow, name="slow", next="on_time", deadline=5, on_deadline="fallback")


@timely.step(next=None)
def on_time(ctx: StepContext, state: Trip) -> None:
    state.log.append("on_time")


@timely.step(next=None)
def fallback(ctx: StepContext, state: Trip) -> None:
    state.log.append("fallback")


strict: Workflow[Trip] = Workflow("strict", version=1, state=Trip)
strict.step(begin, name="begin", start=True, next="slow")
strict.compensation("begin", retry=QUICK)(_undo("begin"))
strict.step(_slow, name="slow", next=None, deadline=5)

# -- a family: home -> fork(a: kid, a child workflow; b: side) -> join -> settle (fails) -----------
# `pair`, the child, waits for "go" and then completes two compensable steps, so a test decides
# whether it completes before or after the other branch.

pair: Workflow[Trip] = Workflow("pair", version=1, state=Trip)
pair.wait("pair_go", signals={"go": "pair_one"}, start=True)


@pair.step(next="pair_two")
def pair_one(ctx: StepContext, state: Trip) -> None:
    ctx.record("p1")


@pair.step(next=None)
def pair_two(ctx: StepContext, state: Trip) -> None:
    ctx.record("p2")


for _name in ("pair_one", "pair_two"):
    pair.compensation(_name, retry=QUICK)(_undo(_name))

family: Workflow[Trip] = Workflow("family", version=1, state=Trip)


@family.step(start=True, next="split")
def home(ctx: StepContext, state: Trip) -> None:
    ctx.record("h")


family.fork("split", branches={"a": "kid", "b": "side"})


@family.child(workflow="pair", next="meet")
def kid(ctx: StepContext, state: Trip) -> dict[str, Any]:
    return {}


@family.step(next="meet")
def side(ctx: StepContext, state: Trip) -> None:
    ctx.record("s")


family.join("meet", fork="split", next="settle")


@family.step(next=None, retry=Retry(max_attempts=1))
def settle(ctx: StepContext, state: Trip) -> None:
    raise Declined("no")


for _name in ("home", "side"):
    family.compensation(_name, retry=QUICK)(_undo(_name))

# -- a running child: home -> fork(a: kid, a child busy in its handler; b: side -> give_up (fails)) ---
# `busy`, the child, completes a compensable step and then holds in `busy_work` (CHILD_BUSY) until
# the test releases it (CHILD_RELEASE); the other branch fails only once the child is busy.

CHILD_BUSY: dict[str, asyncio.Event] = {}
"""The test's events, under "busy" and "release"."""

busy: Workflow[Trip] = Workflow("busy", version=1, state=Trip)


@busy.step(start=True, next="busy_work")
def busy_one(ctx: StepContext, state: Trip) -> None:
    ctx.record("b1")


busy.compensation("busy_one", retry=QUICK)(_undo("busy_one"))


@busy.step(next=None)
async def busy_work(ctx: StepContext, state: Trip) -> None:
    CHILD_BUSY["busy"].set()
    await CHILD_BUSY["release"].wait()
    state.log.append("busy_work")


parent: Workflow[Trip] = Workflow("parent", version=1, state=Trip)
parent.step(home, name="home", start=True, next="split")
parent.compensation("home", retry=QUICK)(_undo("home"))
parent.fork("split", branches={"a": "kid", "b": "side"})


@parent.child(workflow="busy", name="kid", next="meet")
def busy_kid(ctx: StepContext, state: Trip) -> dict[str, Any]:
    return {}


@parent.step(name="side", next="give_up")
async def waits_for_the_child(ctx: StepContext, state: Trip) -> None:
    await CHILD_BUSY["busy"].wait()
    ctx.record("s")


parent.compensation("side", retry=QUICK)(_undo("side"))


@parent.step(next="meet", retry=Retry(max_attempts=1))
def give_up(ctx: StepContext, state: Trip) -> None:
    raise Declined("no")


parent.join("meet", fork="split", next="settle")
parent.step(settle, name="settle", next=None, retry=Retry(max_attempts=1))

# -- deadlines on the start step and on a wait -------------------------------------------------------

hasty: Workflow[Trip] = Workflow("hasty", version=1, state=Trip)
hasty.step(_slow, name="slow", start=True, next="on_time", deadline=5, on_deadline="fallback")
hasty.step(on_time, name="on_time", next=None)
hasty.step(fallback, name="fallback", next=None)

patient: Workflow[Trip] = Workflow("patient", version=1, state=Trip)
patient.step(book, name="book", start=True, next="linger")
patient.compensation("book", retry=QUICK)(_undo("book"))
patient.wait("linger", signals={"go": "finish"}, timeout=3600, on_timeout="finish", deadline=60,
             on_deadline="fallback")
patient.step(finish, name="finish", next=None)
patient.step(fallback, name="fallback", next=None)

stubborn: Workflow[Trip] = Workflow("stubborn", version=1, state=Trip)
stubborn.step(book, name="book", start=True, next="linger")
stubborn.compensation("book", retry=QUICK)(_undo("book"))
stubborn.wait("linger", signals={"go": "finish"}, deadline=60)
stubborn.step(finish, name="finish", next=None)

sleepy: Workflow[Trip] = Workflow("sleepy", version=1, state=Trip)
sleepy.timer("nap", next="finish", delay=3600, start=True, deadline=60, on_deadline="fallback")
sleepy.step(finish, name="finish", next=None)
sleepy.step(fallback, name="fallback", next=None)

# -- a last step that outlives its instance's deadline: book (compensated) -> last_word (held) -> end ----

tardy: Workflow[Trip] = Workflow("tardy", version=1, state=Trip)
tardy.step(book, name="book", start=True, next="last_word")
tardy.compensation("book", retry=QUICK)(_undo("book"))
tardy.step(_slow, name="last_word", next=None)

# -- waits left after their deadline: a signal folding into a held step (wary), a timeout due first (hurried) --

wary: Workflow[Trip] = Workflow("wary", version=1, state=Trip)
wary.step(book, name="book", start=True, next="linger")
wary.wait("linger", signals={"go": "dawdle"}, deadline=60, on_deadline="fallback")
wary.step(_slow, name="dawdle", next="finish")
wary.step(finish, name="finish", next=None)
wary.step(fallback, name="fallback", next=None)

hurried: Workflow[Trip] = Workflow("hurried", version=1, state=Trip)
hurried.step(book, name="book", start=True, next="linger")
hurried.wait("linger", signals={"go": "finish"}, timeout=30, on_timeout="finish", deadline=60,
             on_deadline="fallback")
hurried.step(finish, name="finish", next=None)
hurried.step(fallback, name="fallback", next=None)

# -- a compensation two workers race for: the first call holds until the test releases it (RACE) ---

RACE: dict[str, asyncio.Event] = {}
"""The test's events, under "entered" (taken by the first call only) and "release"."""

touchy: Workflow[Trip] = Workflow("touchy", version=1, state=Trip)
touchy.step(book, name="book", start=True, next="hold_on")
touchy.wait("hold_on", signals={"done": "finish"})
touchy.step(finish, name="finish", next=None)


@touchy.compensation("book", retry=Retry(max_attempts=1))
async def undo_touchy(ctx: CompensationContext, state: Trip, recorded: Any) -> None:
    CALLS.append((ctx.instance_id, "book"))
    entered = RACE.pop("entered", None)
    if entered is not None:
        entered.set()
        await RACE["release"].wait()
    raise Boom("the hotel's system is down")


# -- children of either cancel policy: home -> fork(a: kid, goes with its parent; b: loose, detached) --

policies: Workflow[Trip] = Workflow("policies", version=1, state=Trip)
policies.step(home, name="home", start=True, next="split")
policies.compensation("home", retry=QUICK)(_undo("home"))
policies.fork("split", branches={"a": "kid", "b": "loose"})
policies.child(kid, name="kid", workflow="pair", next="meet")
policies.child(kid, name="loose", workflow="pair", next="meet", cancel_with_parent=False)
policies.join("meet", fork="split", next="finish")
policies.step(finish, name="finish", next=None)

# -- a step left in time, its instance waiting on past its deadline: begin (5 s) -> linger -> on_time ----

punctual: Workflow[Trip] = Workflow("punctual", version=1, state=Trip)
punctual.step(begin, name="begin", start=True, next="linger", deadline=5, on_deadline="fallback")
punctual.wait("linger", signals={"go": "on_time"})
punctual.step(on_time, name="on_time", next=None)
punctual.step(fallback, name="fallback", next=None)

# -- a detached child that may fail: home (compensable) -> loose (a `brittle` child, detached) -> settle ---
# (settle fails while FAIL says so, FAIL[(parent, "settle")])
# `brittle` waits for "go", then its step fails while FAIL says so (FAIL[(child, "brittle_work")]).

brittle: Workflow[Trip] = Workflow("brittle", version=1, state=Trip)
brittle.wait("brittle_go", signals={"go": "brittle_work"}, start=True)


@brittle.step(next=None, retry=Retry(max_attempts=1))
def brittle_work(ctx: StepContext, state: Trip) -> None:
    _maybe_fail(ctx.instance_id, "brittle_work")


loosening: Workflow[Trip] = Workflow("loosening", version=1, state=Trip)
loosening.step(home, name="home", start=True, next="loose")
loosening.compensation("home", retry=QUICK)(_undo("home"))
loosening.child(kid, name="loose", workflow="brittle", next="settle", cancel_with_parent=False)
loosening.step(tour_settle, name="settle", next=None, retry=Retry(max_attempts=1))

# -- a race: home -> fork(a: prep -> kid (a `pair` child) -> linger (waits "late"); b: lead (waits "go")) ---
# -> join (one branch is enough) -> settle (fails). Branch b's "go" makes a the loser, after its child completed.

rivals: Workflow[Trip] = Workflow("rivals", version=1, state=Trip)
rivals.step(home, name="home", start=True, next="split")
rivals.fork("split", branches={"a": "prep", "b": "lead"})


@rivals.step(next="kid")
def prep(ctx: StepContext, state: Trip) -> None:
    ctx.record("p")


rivals.child(kid, name="kid", workflow="pair", next="linger")
rivals.wait("linger", signals={"late": "meet"})
rivals.wait("lead", signals={"go": "meet"})
rivals.join("meet", fork="split", next="settle", need=1)
rivals.step(settle, name="settle", next=None, retry=Retry(max_attempts=1))
for _name in ("home", "prep"):
    rivals.compensation(_name, retry=QUICK)(_undo(_name))

# -- twins: home -> fork(a: kid, b: kid, each a `pair` child) -> join -> finish --------------------------

twins: Workflow[Trip] = Workflow("twins", version=1, state=Trip)
twins.step(home, name="home", start=True, next="split")
twins.compensation("home", retry=QUICK)(_undo("home"))
twins.fork("split", branches={"a": "kid", "b": "kid_b"})
twins.child(kid, name="kid", workflow="pair", next="meet")
twins.child(kid, name="kid_b", workflow="pair", next="meet")
twins.join("meet", fork="split", next="finish")
twins.step(finish, name="finish", next=None)

registry = Registry(linear, waiting, forked, plain, leg, trip, timely, strict, pair, family, busy, parent, hasty,
                    patient, stubborn, sleepy, touchy, policies, punctual, tour, tardy, wary,
                    hurried, brittle, loosening, rivals, twins)
