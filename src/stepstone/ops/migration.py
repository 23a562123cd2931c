"""In-flight migration: move running instances to another version of their definition, in the open.

    report = await migrate(store.definitions, to=orders_v2, definition="orders", from_version=1,
                           step_map={"ship": "ship_parcel"}, state_transform=add_currency, dry_run=True)

Before anything is written, each instance is checked against the target plan: every live position (the
root and each live branch) has its step mapped (through `step_map`, whose every source step exists in
the instance's version, else by the same name) to a step of the target of the same kind; a wait maps to
a wait that accepts every signal and message the old one accepted and has a timeout exactly when the old
one had; a fork with live branches keeps its name and each live branch's mapped step still leads to that
fork's join in the target, whose need (counted on the instance's branches) is the source's: the join's
progress is kept as it is; a waiting task, external step or message wait keeps its name (its task or
subscription names the step), and so does a step whose deadline runs, mapped to one with a deadline
(and a step without one to one without), and a completed step whose compensation is still owed, whose
compensation the target declares; every open command's step and every queued signal still exists
in the target; and the state `state_transform` returns fits the target's state model. The source steps
are those of the plan the instance is pinned to, looked up by its plan hash: an instance whose plan is not
stored (admitted before its id was registered; the version may since be stored with other code) is refused,
since none of its steps could be checked. Each instance is answered: migrated, refused (with why) or
skipped (already on the target, or ended).

An accepted migration is one fenced transaction between two segments (`migrate_in_order`,
migrations 0008 and 0017) at its place in the instance's command order, reserved when it is first
planned: it waits ('queued') until every command queued before it that can run now has run, so a
signal sent before the migration is applied on the version it was sent to (commands that cannot run,
because no live worker serves the pinned version, do not hold it back); it is refused while a
step of the instance runs, or when the instance moved since it was checked, and is then checked
again from scratch, so it applies once, on the state it was checked on. It records a settled
MIGRATION command at its place in the order and an INSTANCE_MIGRATED history entry with the full new
state (a baseline). Pin admission refuses a target that is not AVAILABLE. A caller that cannot get
its turn within `patience` seconds (no worker runs the commands ahead of it) is answered refused,
with nothing changed.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from stepstone.authoring.workflow import Workflow
from stepstone.core.model import TERMINAL
from stepstone.core.pin import Pin
from stepstone.core.plan import Plan, Step
from stepstone.errors import InstanceNotFound, InvalidInput, MigrationRefused, StepstoneError
from stepstone.store.registry_port import DefinitionsPort

__all__ = ["MigrationOutcome", "MigrationReport", "migrate", "migrate_one"]

_LIVE = ("RUNNING", "WAITING", "FAILED")
DEFAULT_PATIENCE = 30.0
"""Seconds a migration waits for its turn (commands queued before it, a running step) before refusing."""


@dataclass(frozen=True)
class MigrationOutcome:
    instance_id: str
    outcome: str
    """migrated, would migrate (dry run), refused or skipped."""
    reason: str = ""


@dataclass
class MigrationReport:
    dry_run: bool
    outcomes: list[MigrationOutcome] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(o.outcome for o in self.outcomes))

    def raise_for_refusals(self) -> None:
        """MigrationRefused naming the first refused instance and why, if any was refused."""
        for o in self.outcomes:
            if o.outcome == "refused":
                raise MigrationRefused(f"migration of instance {o.instance_id} refused: {o.reason}",
                                       instance_id=o.instance_id)


class _Refused(Exception):
    pass


async def migrate(
    definitions: DefinitionsPort,
    instances: str | list[str] | None = None,
    *,
    to: Workflow[Any],
    definition: str | None = None,
    from_version: int | None = None,
    scope: str | None = None,
    step_map: Mapping[str, str] | None = None,
    state_transform: Callable[[Any], Any] | None = None,
    dry_run: bool = False,
    actor: str | None = None,
    patience: float = DEFAULT_PATIENCE,
    page: int = 1000,
) -> MigrationReport:
    """Migrate one instance, a list, or every instance of (`definition`, `from_version`[, `scope`]) that may
    still run, read `page` at a time, oldest first, to the version of `to`. Returns the per-instance report;
    `dry_run` checks and writes nothing."""
    if instances is not None:
        chosen: AsyncIterator[str] = _named([instances] if isinstance(instances, str) else instances)
    elif definition is None or from_version is None:
        raise InvalidInput("name the instances, or a definition and a from_version to migrate", what="filter")
    else:
        chosen = _candidates(definitions, definition, from_version, scope, page)
    report = MigrationReport(dry_run)
    async for instance_id in chosen:
        try:
            outcome = await migrate_one(
                definitions, instance_id, to=to, step_map=step_map or {}, state_transform=state_transform,
                dry_run=dry_run, actor=actor, patience=patience)
        except InstanceNotFound:
            if isinstance(instances, str):  # one instance named alone: its own error
                raise
            # one id of several: answered like the others, which go on (those before it are migrated already)
            outcome = MigrationOutcome(instance_id, "refused", _ANSWERS["not_found"][1])
        report.outcomes.append(outcome)
    return report


async def _named(instances: list[str]) -> AsyncIterator[str]:
    for instance_id in instances:
        yield instance_id


async def _candidates(
    definitions: DefinitionsPort, definition: str, from_version: int, scope: str | None, page: int,
) -> AsyncIterator[str]:
    """Every candidate of the version, in keyset pages: all of them, however many (a refused or skipped one
    stays a candidate, so the pages go on after it, never from the start again)."""
    after: tuple[datetime, str] | None = None
    while True:
        rows = await definitions.migration_candidates(definition, from_version, scope, page, after)
        for instance_id, _ in rows:
            yield instance_id
        if len(rows) < page:
            return
        after = (rows[-1][1], rows[-1][0])


async def migrate_one(
    definitions: DefinitionsPort, instance_id: str, *, to: Workflow[Any], step_map: Mapping[str, str],
    state_transform: Callable[[Any], Any] | None, dry_run: bool = False, actor: str | None = None,
    patience: float = DEFAULT_PATIENCE,
) -> MigrationOutcome:
    """Check and (unless `dry_run`) migrate one instance; see the module docstring."""
    target = to.plan
    delay = 0.01
    deadline = time.monotonic() + patience
    order_seq: int | None = None
    outcome = "changed"
    while True:
        view = await definitions.migration_view(instance_id)
        early = _settled_already(instance_id, view, target)
        if early is not None:
            return early
        try:
            positions, commands_map, state = _plan(view, to, target, step_map, state_transform)
        except _Refused as exc:
            return MigrationOutcome(instance_id, "refused", str(exc))
        to_pin = _pin({**view, "version": target.version, "plan_hash": target.plan_hash})
        try:
            if dry_run:
                await definitions.check_admission(instance_id, to_pin)
                return MigrationOutcome(instance_id, "would migrate")
            if order_seq is None:  # the migration's place in the instance's order: behind what is queued now
                order_seq = await definitions.reserve_command_seq()
            outcome, _ = await definitions.migrate_instance(
                instance_id, order_seq=order_seq, from_pin=_pin(view), state_version=int(view["state_version"]),
                to_pin=to_pin, step_map=commands_map, positions=positions, state=state, actor=actor,
            )
        except StepstoneError as exc:  # pin admission: the target is not AVAILABLE
            return MigrationOutcome(instance_id, "refused", str(exc).splitlines()[0])
        if outcome in _ANSWERS:
            answer, reason = _ANSWERS[outcome]
            return MigrationOutcome(instance_id, answer, reason.format(version=target.version))
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(delay)  # queued behind commands, busy (a step runs) or changed since read: again
        delay = min(delay * 2, 0.5)
    return MigrationOutcome(instance_id, "refused", _GAVE_UP[outcome].format(patience=patience))


_GAVE_UP = {
    "queued": "commands queued before the migration were not applied within {patience:g} s (does a worker "
              "serve this version?); nothing was changed",
    "busy": "a step of the instance was running for {patience:g} s; nothing was changed, try again",
    "changed": "the instance kept moving for {patience:g} s; nothing was changed, try again",
}


_ANSWERS = {
    "migrated": ("migrated", ""),
    "already": ("skipped", "already on v{version}"),
    "ended": ("skipped", "instance ended"),
    "not_found": ("refused", "no such instance"),
}


def _settled_already(instance_id: str, view: Mapping[str, Any], target: Plan) -> MigrationOutcome | None:
    if view["version"] == target.version and view["plan_hash"] == target.plan_hash:
        return MigrationOutcome(instance_id, "skipped", f"already on v{target.version}")
    if view["status"] in TERMINAL:  # migrate_instance skips the same ends (migration 0044)
        return MigrationOutcome(instance_id, "skipped", f"instance is {view['status']}")
    return None


def _pin(view: Mapping[str, Any]) -> Pin:
    return Pin(str(view["definition_scope"]), str(view["definition_id"]), int(view["version"]),
               str(view["plan_hash"]))


def _plan(
    view: Mapping[str, Any], to: Workflow[Any], target: Plan, step_map: Mapping[str, str],
    state_transform: Callable[[Any], Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, str], Any]:
    if view["definition_id"] != target.definition_id:
        raise _Refused(f"instance runs {view['definition_id']!r}, not {target.definition_id!r}")
    source = _source_steps(view)
    unknown = sorted(set(step_map) - set(source))
    if unknown:  # a typo on the left would otherwise be passed over, and the step it meant not mapped
        raise _Refused(f"step_map maps {', '.join(map(repr, unknown))}, which v{view['version']} does not have "
                       f"(its steps: {', '.join(source)})")
    positions = []
    for p in view["positions"]:
        row = {k: p[k] for k in ("path", "step", "visit", "status")}
        if p["status"] in _LIVE:
            row.update(_position_target(p, source, target, step_map, int(view["version"])))
            if p["path"]:
                _check_branch(str(p["path"]), str(row["to_step"]), target, step_map)
        positions.append(row)
    commands_map = {}
    for step in view["command_steps"]:
        mapped = step_map.get(step, step)
        if mapped not in target.steps:
            raise _Refused(f"a queued command is for step {step!r}, which maps to {mapped!r}: "
                           f"v{target.version} has no such step")
        commands_map[step] = mapped
    for step in view.get("owed_compensations") or ():
        _check_owed(str(step), step_map, target)
    missing = sorted(set(view["open_signals"]) - target.signal_names)
    if missing:
        raise _Refused(f"queued signal(s) {', '.join(missing)} would be unknown to v{target.version}")
    state = copy.deepcopy(view["state"])
    if state_transform is not None:
        try:
            state = state_transform(state)
        except Exception as exc:  # noqa: BLE001 - the author's transform: its failure refuses this instance
            raise _Refused(f"state_transform raised {type(exc).__name__}: {exc}") from None
    try:
        state = to.state_to_json(state, what="migrated state")
    except InvalidInput as exc:
        raise _Refused(f"the transformed state does not fit v{target.version}'s state model: {exc}") from None
    return positions, commands_map, state


def _source_steps(view: Mapping[str, Any]) -> dict[str, Any]:
    """The steps of the plan the instance is pinned to (by its hash); refused when that plan is not stored,
    since none of its steps could be checked (another plan stored under the version is not its plan)."""
    if view["plan"] is not None:
        return {s["name"]: s for s in view["plan"].get("steps", [])}
    version = view["version"]
    stored = view.get("stored_plan_hash")
    found = f"v{version} is stored with plan {stored[:12]}" if stored else f"no v{version} is"
    then = "" if stored else "register that version's code, then migrate; "
    raise _Refused(f"the instance runs {view['definition_id']!r} v{version} with plan {view['plan_hash'][:12]}, "
                   f"which is not stored ({found}): its steps cannot be checked; {then}nothing was changed")


def _position_target(
    p: Mapping[str, Any], source: Mapping[str, Any], target: Plan, step_map: Mapping[str, str], from_version: int,
) -> dict[str, Any]:
    step = p["step"]
    mapped = step_map.get(step, step)
    where = f"position {p['path']!r} at step {step!r}" if p["path"] else f"position at step {step!r}"
    goal = target.steps.get(mapped)
    if goal is None:
        steps = ", ".join(target.steps)
        if step in step_map:
            raise _Refused(f"{where} maps to {mapped!r} through step_map, but v{target.version} has no such step "
                           f"(its steps: {steps})")
        raise _Refused(f"{where}: v{target.version} has no step {step!r}; map it with step_map to one of its "
                       f"steps ({steps})")
    was = source.get(step, {})
    if was and was.get("kind") != goal.kind:
        raise _Refused(f"step {step!r} is a {was.get('kind')} step, {mapped!r} in v{target.version} a {goal.kind}")
    to_wait: Any = None
    waiting = p["status"] == "WAITING"
    if was and p["status"] in ("RUNNING", "WAITING"):
        _check_deadline(step, was, mapped, goal, target.version)
    if goal.kind == "wait" and waiting:
        to_wait = _wait_target(step, was, mapped, goal, target.version)
    elif goal.kind == "task" and waiting:
        if mapped != step:  # the open task row names its step
            raise _Refused(f"task step {step!r} is waiting for its task: it keeps its name ({mapped!r} given)")
        lost = sorted(set((was.get("decisions") or {}).keys()) - set(goal.decisions))
        if lost:
            raise _Refused(f"task {step!r} accepts decision(s) {', '.join(lost)}, which v{target.version} does not")
    elif goal.kind == "external" and waiting and mapped != step:
        # its open task names the step, and a fetch hands out only a task its position waits for at that step
        raise _Refused(f"external step {step!r} is waiting for its task: it keeps its name ({mapped!r} given)")
    elif goal.kind == "fork" and waiting:
        if mapped != step:  # the branches' paths and their reports name the fork
            raise _Refused(f"fork {step!r} has live branches: it keeps its name ({mapped!r} given)")
        to_wait = {**(p.get("wait") or {}), "join": target.join_of(mapped).name}
    if goal.kind == "fork" and (p.get("wait") or {}).get("kind") == "join":
        _check_need(p["wait"], source, target.join_of(mapped), from_version, target.version)
    return {"to_step": mapped, "to_wait": to_wait}


def _wait_target(step: str, was: Mapping[str, Any], mapped: str, goal: Step, version: int) -> dict[str, Any]:
    for what, old_names, new_names in (("signal", was.get("signals"), goal.signals),
                                       ("message", was.get("messages"), goal.messages)):
        lost = sorted(set((old_names or {}).keys()) - set(new_names))
        if lost:
            raise _Refused(f"wait {step!r} accepts {what}(s) {', '.join(lost)}, which {mapped!r} in v{version} "
                           "does not")
    if (was.get("timeout_seconds") is None) != (goal.timeout_seconds is None):
        raise _Refused(f"wait {step!r} and {mapped!r} differ in having a timeout")
    if was.get("messages") and (mapped != step or was.get("correlation") != goal.correlation):
        # its open subscriptions name the step and were correlated by the old key
        raise _Refused(f"wait {step!r} waits for messages: it keeps its name and correlation")
    wait: dict[str, Any] = {"kind": "signal", "signals": dict(goal.signals), "timeout_seconds": goal.timeout_seconds}
    if goal.messages:
        wait["messages"] = dict(goal.messages)
    return wait


def _check_owed(step: str, step_map: Mapping[str, str], target: Plan) -> None:
    """A completed saga step whose compensation is still owed is undone by its name (its compensation
    record names it), so it keeps the name and the target declares its compensation."""
    mapped = step_map.get(step, step)
    if mapped != step:
        raise _Refused(f"step {step!r} completed with its compensation owed: it keeps its name ({mapped!r} given)")
    goal = target.steps.get(step)
    if goal is None or goal.compensation is None:
        raise _Refused(f"step {step!r} completed with its compensation owed, which v{target.version} does not declare")


def _check_deadline(step: str, was: Mapping[str, Any], mapped: str, goal: Step, version: int) -> None:
    """A step deadline runs on a timer scheduled when the step was entered, which names the step and fires
    whatever the target says: a step whose deadline runs keeps it and its name, and one without gets none."""
    if bool(was.get("deadline")) != (goal.deadline_seconds is not None):
        raise _Refused(f"step {step!r} and {mapped!r} in v{version} differ in having a step deadline")
    if was.get("deadline") and mapped != step:
        raise _Refused(f"step {step!r} has a step deadline running: it keeps its name ({mapped!r} given)")


def _check_need(wait: Mapping[str, Any], source: Mapping[str, Any], join: Step, from_version: int,
                to_version: int) -> None:
    """A join being waited at keeps the count it needs: the migration keeps the fork's progress as it is
    (migration 0025), and a changed need could make a join already met, or already impossible because
    of a failed branch, inconsistent with the instance's status (docs/branches.md)."""
    total, need = int(wait["total"]), int(wait["need"])
    if (total if join.need == 0 else min(join.need, total)) == need:
        return
    joins = (s for s in source.values() if s.get("kind") == "join" and s.get("fork") == wait.get("fork"))
    was: Mapping[str, Any] = next(joins, {})
    old = str(wait.get("join") or was.get("name") or "")
    name = repr(join.name) if old == join.name else f"{old!r} ({join.name!r} in v{to_version})"
    raise _Refused(f"join {name} needs {_need_text(was.get('need', need))} in v{from_version} and "
                   f"{_need_text(join.need)} in v{to_version}: an instance waiting at it cannot move (it needs "
                   f"{need} of its {total} branches); migrate it once the join has fired, or keep the join's need")


def _need_text(need: Any) -> str:
    return "all" if need == 0 else "any" if need == 1 else str(need)


def _check_branch(path: str, to_step: str, target: Plan, step_map: Mapping[str, str]) -> None:
    """A live branch stays a branch of the same fork and can still reach that fork's join."""
    parts = path.split("/")  # fork/branch, nested: fork/branch/fork/branch
    fork = parts[-2] if len(parts) >= 2 else ""
    goal = target.steps.get(fork)
    if goal is None or goal.kind != "fork" or step_map.get(fork, fork) != fork:
        raise _Refused(f"live branch {path!r} belongs to fork {fork!r}, which v{target.version} does not have "
                       "under that name")
    join = target.join_of(fork).name
    if not target.reaches(to_step, join):
        raise _Refused(f"live branch {path!r} maps to {to_step!r}, which in v{target.version} never reaches "
                       f"the join {join!r} of fork {fork!r}")
