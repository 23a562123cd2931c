"""Human task steps in the core: the completion command and the task's own timers.

Entering a task step is `core.task_entering`. A completion arrives as a TASK_COMPLETION command
that the store recorded while reserving the task (OPEN -> COMPLETING); here it either completes the
task and moves on, or is refused and reopens the task.
"""

from __future__ import annotations

from datetime import datetime

from stepstone.core.effects import ChangeTask, CloseTimers, EmitEvent
from stepstone.core.effects import RecordHistory as History
from stepstone.core.entering import enter, settled
from stepstone.core.model import WAITING, CommandView, Decision, InstanceView, Settle
from stepstone.core.plan import Plan

# Outbox events of a task's own timers; far above any index a handler's events use in one visit.
_REMINDER_EVENT = 10_000
_ESCALATION_EVENT = 10_001


def task_completed(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    """A reserved completion: complete the task and go on, or refuse it and reopen the task."""
    wait = instance.wait or {}
    body = command.payload if isinstance(command.payload, dict) else {}
    tid = str(body.get("task_id"))
    decision = str(body.get("decision"))
    actor = body.get("actor")
    waiting = (instance.position_status or instance.status) == WAITING
    reason = None
    if not waiting or wait.get("kind") != "task" or wait.get("task_id") != tid or command.visit != instance.visit:
        reason = "TASK_NOT_CURRENT"
    elif decision not in (wait.get("decisions") or {}):
        reason = "UNKNOWN_DECISION"
    if reason is not None:
        data = {"task_id": tid, "decision": decision, "actor": actor, "reason": reason}
        return Decision(Settle("REJECTED", reason), (History("TASK_COMPLETION_REFUSED", instance.step,
                                                             instance.visit, data),
                                                     ChangeTask(tid, "reopen", {"reason": reason})))
    step = plan.steps[instance.step or ""]
    outcome = {"id": tid, "decision": decision, "payload": body.get("payload"), "actor": actor}
    entered = enter(instance, plan, wait["decisions"][decision], instance.state, now, cause={"task": outcome})
    done = History("TASK_COMPLETED", step.name, instance.visit, {"task_id": tid, "decision": decision,
                                                                 "actor": actor})
    change = ChangeTask(tid, "complete", {"decision": decision, "actor": actor})
    return Decision(settled(entered), (done, change, CloseTimers(), *entered))


def task_timer(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    """A task's reminder, due date or expiry fired while the position waits at the task."""
    wait = instance.wait or {}
    waiting = (instance.position_status or instance.status) == WAITING
    if not waiting or command.visit != instance.visit:
        return Decision(Settle("STALE", "TIMER_SUPERSEDED"))
    step = plan.steps[instance.step or ""]
    spec = step.task
    tid = str(wait.get("task_id"))
    name, visit = step.name, instance.visit
    if command.name == "remind" or spec is None:
        event = EmitEvent("stepstone.task.reminder", {"task_id": tid, "instance_id": instance.id, "step": name},
                          key=tid, index=_REMINDER_EVENT)
        return Decision(Settle("COMPLETE"), (History("TASK_REMINDED", name, visit, {"task_id": tid}),
                                             ChangeTask(tid, "remind"), event))
    if command.name == "due":
        if spec.escalate_user or spec.escalate_group:
            to = {"user": spec.escalate_user, "group": spec.escalate_group}
            event = EmitEvent("stepstone.task.escalated", {"task_id": tid, "instance_id": instance.id, **to},
                              key=tid, index=_ESCALATION_EVENT)
            return Decision(Settle("COMPLETE"), (History("TASK_ESCALATED", name, visit, {"task_id": tid, **to}),
                                                 ChangeTask(tid, "escalate", to), event))
        return Decision(Settle("COMPLETE"), (History("TASK_OVERDUE", name, visit, {"task_id": tid}),))
    entered = enter(instance, plan, spec.on_expire or "", instance.state, now)
    return Decision(settled(entered), (History("TASK_EXPIRED", name, visit, {"task_id": tid}),
                                       ChangeTask(tid, "expire"), CloseTimers(), *entered))

