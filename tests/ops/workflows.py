"""Workflows of the operations tests: retries, branches, and a state with sensitive fields."""

from __future__ import annotations

import asyncio
from typing import Annotated

import asyncpg
from pydantic import BaseModel, Field

from stepstone import CompensationContext, Registry, Retry, StepContext, Workflow
from stepstone.authoring.sensitive import Sensitive
from stepstone.core.plan import Plan
from stepstone.testing import Engine

FAILURES: dict[str, int] = {}
"""instance id -> how many more times `flaky.work` raises."""

SECRET = "4111-1111-1111-1111-canary"  # noqa: S105 - the canary value, not a credential


class Job(BaseModel):
    name: str = "job"
    log: list[str] = Field(default_factory=list)
    results: dict[str, int] = Field(default_factory=dict)
    counter: int = 0


class Busy(Exception):
    pass


flaky: Workflow[Job] = Workflow("ops_flaky", version=1, state=Job)


@flaky.step(start=True, next="done", retry=Retry(max_attempts=5, backoff=30))
def work(ctx: StepContext, state: Job) -> None:
    left = FAILURES.get(ctx.instance_id, 0)
    if left == -1:
        raise Busy("down for good")
    if left > 0:
        FAILURES[ctx.instance_id] = left - 1
        raise Busy(f"upstream busy (attempt {ctx.attempt})")
    state.log.append(f"work@{ctx.attempt}")


@flaky.step(next=None)
def done(ctx: StepContext, state: Job) -> None:
    state.log.append("done")


# -- prepare -> fork(left, right) -> join -> finish (finish can fail) ------------------------------

forky: Workflow[Job] = Workflow("ops_forky", version=1, state=Job)


@forky.step(start=True, next="split")
def prepare(ctx: StepContext, state: Job) -> None:
    state.counter += 1
    state.log.append(f"prepare:{state.counter}")


forky.fork("split", branches={"left": "left", "right": "right"})


@forky.step(next="together")
def left(ctx: StepContext, state: Job) -> None:
    state.results["left"] = state.results.get("left", 0) + 1


@forky.step(next="together")
def right(ctx: StepContext, state: Job) -> None:
    state.results["right"] = state.results.get("right", 0) + 1


forky.join("together", fork="split", next="finish")


@forky.step(next=None, retry=Retry(max_attempts=1))
def finish(ctx: StepContext, state: Job) -> None:
    if FAILURES.get(ctx.instance_id, 0):
        FAILURES[ctx.instance_id] -= 1
        raise Busy("downstream refused")
    state.log.append("finish")


# -- sensitive fields ------------------------------------------------------------------------------

class Holder(BaseModel):
    name: str
    pin: str = Field(default="", json_schema_extra={"sensitive": True})


class Payment(BaseModel):
    order: str
    card: Annotated[str, Sensitive]
    holder: Holder
    note: str = ""
    log: list[str] = Field(default_factory=list)


def mask_tokens(text: str) -> str:
    """The redaction hook of `payment`: anything that looks like an API token."""
    return text.replace("tok_live_", "tok_[redacted]_")


payment: Workflow[Payment] = Workflow("ops_payment", version=1, state=Payment, redact=mask_tokens)


@payment.step(start=True, next="settle", retry=Retry(max_attempts=3, backoff=5))
def charge(ctx: StepContext, state: Payment) -> None:
    if ctx.attempt == 1:
        raise Busy(f"card {state.card} declined for {state.holder.name} (pin {state.holder.pin}) tok_live_abc")
    state.card = state.card + "-v2"
    state.holder.pin = state.holder.pin + "9"
    state.log.append("charged")


@payment.step(next=None)
def settle(ctx: StepContext, state: Payment) -> None:
    state.note = "settled"


# -- a signal whose payload model marks a field sensitive, and a child with a sensitive state ----------

OTP = "550199-otp-canary"  # the signal's secret; "canary" as in SECRET, so one search finds both


class Otp(BaseModel):
    otp: Annotated[str, Sensitive]
    channel: str = "sms"


class Vault(BaseModel):
    card: Annotated[str, Sensitive]
    stored: bool = False


vault: Workflow[Vault] = Workflow("ops_vault", version=1, state=Vault)


@vault.step(start=True, next=None)
def store_card(ctx: StepContext, state: Vault) -> None:
    state.stored = True


class Confirmation(BaseModel):
    order: str
    card: Annotated[str, Sensitive]
    otp: Annotated[str, Sensitive] = ""
    from_child: str = ""


confirmed: Workflow[Confirmation] = Workflow("ops_confirmed", version=1, state=Confirmation, redact=mask_tokens)
# A signal sent during the pause is parked (kept whole), then applied when the wait is entered.
confirmed.timer("pause", next="await_otp", delay=10, start=True)
confirmed.wait("await_otp", signals={"otp": "check_otp"}, payloads={"otp": Otp})


@confirmed.step(next="keep_card", retry=Retry(max_attempts=3, backoff=5))
def check_otp(ctx: StepContext, state: Confirmation) -> None:
    assert ctx.signal is not None
    otp = ctx.signal.payload["otp"]
    if ctx.attempt == 1:  # the retry must still find the payload whole
        raise Busy(f"otp {otp} not valid yet tok_live_def")
    state.otp = otp


@confirmed.child(workflow="ops_vault", next="after_vault")
def keep_card(ctx: StepContext, state: Confirmation) -> dict[str, str]:
    return {"card": state.card}


@confirmed.step(next=None)
def after_vault(ctx: StepContext, state: Confirmation) -> None:
    assert ctx.child is not None
    state.from_child = str(ctx.child.state["card"])  # the child's sensitive value never reaches the parent
    ctx.emit("card.stored", {"order": state.order})


# -- a task decision and a message whose payload models mark a field sensitive -------------------------

class Approval(BaseModel):
    code: Annotated[str, Sensitive]
    note: str = ""


class Paid(BaseModel):
    ref: Annotated[str, Sensitive]


class Approved(BaseModel):
    key: str
    code: Annotated[str, Sensitive] = ""
    ref: Annotated[str, Sensitive] = ""


approval: Workflow[Approved] = Workflow("ops_approval", version=1, state=Approved)
approval.task("approve", title="Approve", decisions={"ok": "took_code"}, payloads={"ok": Approval}, start=True)


@approval.step(next="await_paid")
def took_code(ctx: StepContext, state: Approved) -> None:
    assert ctx.task is not None
    state.code = ctx.task.payload["code"]


approval.wait("await_paid", messages={"paid": "took_ref"}, correlation="key", payloads={"paid": Paid})


@approval.step(next=None)
def took_ref(ctx: StepContext, state: Approved) -> None:
    assert ctx.signal is not None
    state.ref = ctx.signal.payload["ref"]


# -- wake (fails for good where FAILURES says -1) -> nap (a 10 s timer) -> rest -----------------------

napping: Workflow[Job] = Workflow("ops_napping", version=1, state=Job)


@napping.step(start=True, next="nap", retry=Retry(max_attempts=1))
def wake(ctx: StepContext, state: Job) -> None:
    if FAILURES.get(ctx.instance_id) == -1:
        raise Busy("down for good")
    state.log.append("wake")


napping.timer("nap", delay=10, next="rest")


@napping.step(next=None)
def rest(ctx: StepContext, state: Job) -> None:
    state.log.append("rest")


# -- a signal, then a message, each read by the step it leads to (a replay gives it to the step again) --


class Relayed(BaseModel):
    key: str
    n: int = 0
    ref: str = ""
    runs: int = 0


relayed: Workflow[Relayed] = Workflow("ops_relayed", version=1, state=Relayed)
relayed.wait("await_go", signals={"go": "took_signal"}, start=True)


@relayed.step(next="await_paid")
def took_signal(ctx: StepContext, state: Relayed) -> None:
    state.n = ctx.signal.payload["n"] if ctx.signal else -1
    state.runs += 1


relayed.wait("await_paid", messages={"paid": "took_message"}, correlation="key")


@relayed.step(next=None)
def took_message(ctx: StepContext, state: Relayed) -> None:
    state.ref = ctx.signal.payload["ref"] if ctx.signal else "(none)"
    state.runs += 1


booking: Workflow[dict[str, str]] = Workflow("ops_booking", version=1)


@booking.step(start=True, next=None)
def reserve(ctx: StepContext, state: dict[str, str]) -> None:
    ctx.record({"reservation": f"r-{state['guest']}"})  # what its compensation would undo


@booking.compensation("reserve")
def unreserve(_ctx: CompensationContext, state: dict[str, str], recorded: dict[str, str]) -> None:
    state["undone"] = recorded["reservation"]


# -- a parent that waits for a `relayed` child (which waits for a signal, then a message) ---------------

holder: Workflow[Relayed] = Workflow("ops_holder", version=1, state=Relayed)


@holder.child(workflow="ops_relayed", next="after_relayed", start=True)
def start_relayed(ctx: StepContext, state: Relayed) -> dict[str, str]:
    return {"key": state.key}


@holder.step(next=None)
def after_relayed(ctx: StepContext, state: Relayed) -> None:
    assert ctx.child is not None
    state.ref = str(ctx.child.state["ref"])


# -- a parent whose child fails for good while FAILURES["ops_fragile"] is -1 ----------------------------


class Call(BaseModel):
    result: str = ""
    child_id: str = ""


CALLS: list[str] = []
"""The instances ops_fragile's call got through for, one entry each time (the child's effect)."""
HOLD: dict[str, asyncio.Event] = {}
"""With "entered" and "release": ops_fragile's call signals it is under way, then waits to be released."""

fragile: Workflow[Call] = Workflow("ops_fragile", version=1, state=Call)


@fragile.step(start=True, next=None, retry=Retry(max_attempts=1))
async def call(ctx: StepContext, state: Call) -> None:
    if FAILURES.get(fragile.id) == -1:
        raise Busy("upstream down")
    if HOLD:
        HOLD["entered"].set()
        await HOLD["release"].wait()
    CALLS.append(ctx.instance_id)
    state.result = f"paid by {ctx.instance_id}"


caller: Workflow[Call] = Workflow("ops_caller", version=1, state=Call)


@caller.child(workflow="ops_fragile", next="took_result", start=True)
def call_fragile(ctx: StepContext, state: Call) -> dict[str, str]:
    return {}


@caller.step(next=None)
def took_result(ctx: StepContext, state: Call) -> None:
    assert ctx.child is not None
    state.result = str(ctx.child.state["result"])
    state.child_id = ctx.child.instance_id


registry = Registry(flaky, forky, payment, confirmed, vault, approval, napping, relayed, booking, holder, fragile,
                    caller)


async def failed_for_good(engine: Engine, *ids: str) -> None:
    """Make `flaky` fail every attempt of these instances and run until their retries ran out."""
    for iid in ids:
        FAILURES[iid] = -1
    await run_out_backoffs(engine)
    for iid in ids:
        FAILURES.pop(iid, None)


async def run_out_backoffs(engine: Engine, rounds: int = 6) -> None:
    """Run until every retry backoff has passed (each round moves the clock past the longest)."""
    await engine.run_until_idle()
    for _ in range(rounds):
        await engine.move_clock(1000)
        await engine.run_until_idle()


async def failed_rows(conn: asyncpg.Connection, plan: Plan, step: str, n: int, state: str = "{}") -> list[str]:
    """`n` FAILED instances of `plan` at `step`, written straight into the tables (fast): an outage's
    aftermath for the bulk repair tests. Their ids, oldest last."""
    rows = await conn.fetch(
        """
        WITH ins AS (
            INSERT INTO stepstone.instances (id, definition_id, version, plan_hash, status, state, step, visit,
                                             error, history_seq, created_at, updated_at)
            SELECT gen_random_uuid(), $1, 1, $2, 'FAILED', $5::jsonb, $4, 1,
                   '{"type": "Busy", "message": "down"}'::jsonb, 0, now() - make_interval(secs => g), now()
            FROM generate_series(1, $3) AS g
            RETURNING id
        ), pos AS (
            INSERT INTO stepstone.positions (instance_id, path, status, step, visit, created_at, updated_at)
            SELECT id, '', 'FAILED', $4, 1, now(), now() FROM ins
        )
        SELECT id::text AS id FROM ins
        """,
        plan.definition_id, plan.plan_hash, n, step, state,
    )
    return [r["id"] for r in rows]
