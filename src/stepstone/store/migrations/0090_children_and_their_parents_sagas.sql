-- A child that completed while its parent waited for it, whose report the parent had not applied when its
-- saga began, is compensated.
--
-- A child's end is queued as a report (CHILD_COMPLETION) at its parent in the commit that ends it; applying
-- it records a completed child as the parent's compensation (core/saga.py, on_child_completed), and a child
-- still running when the saga begins is cancelled with compensation (record_open_children). A saga that began
-- between the two (a cancel with compensation, the parent's deadline, another branch's failure) settled the
-- queued report CANCELLED unapplied, and the child, COMPLETED, was neither: the parent ended CANCELLED,
-- TIMED_OUT or COMPENSATED with everything else undone and the child's steps left done
-- (tests/sagas/test_children.py, test_a_child_whose_completion_report_waits_when_its_parent_is_cancelled_is_
-- compensated and test_a_deadline_fired_while_a_dead_worker_held_the_childs_report_compensates_the_child
-- printed "assert 'COMPLETED' == 'COMPENSATED'"). saga_begin now records the children it takes over first, while
-- the positions still wait (record_open_children), and such a child among them, as the report would have
-- recorded it (in a plan that declares a compensation): the saga compensates it first, as the parent's newest
-- compensation, and goes on once it reports. Open children and such completed ones are read in one statement,
-- so a child whose last commit lands meanwhile is seen either open (cancelled with compensation, as before) or
-- completed with its report queued (one commit wrote both), never neither; recorded in two statements, the
-- open ones after the commands were settled, such a child could fall between them.
--
-- A FAILED child of a branch that failed on it while its parent goes on without that branch (its join does not
-- need it) is not retried. child_standing said 'awaited' for a position FAILED at the child's visit in any
-- parent that had not ended, so the retry went through; but only a FAILED instance is retried (which runs its
-- failed positions again), and this parent runs on: the child's report reached the failed branch and was
-- ignored, and the join went on, or completed, without it (tests/engine/test_branch_failures.py,
-- test_a_failed_child_of_a_branch_its_join_passed_over_is_not_retried printed "Failed: DID NOT RAISE
-- ChildNotAwaited"). A position FAILED there is awaited now only in a parent that is FAILED too; should the
-- parent fail later, the child is awaited again, and retried after the parent's retry ran its branch again.
--
-- A detached child (cancel_with_parent false) whose parent was cancelled, or timed out, at its child step
-- and compensates, or stopped compensating, is retried as an instance of its own, as once the parent has
-- ended.
--
-- Neither a cancel nor a compensation of its parent touches a detached child (docs/sagas.md), and once the
-- parent has ended with its child step cancelled the child is abandoned and a retry of it goes on
-- (child_standing, version 83). While the parent still compensated, or stopped at COMPENSATION_FAILED
-- (an undo that kept failing, for an operator), the same child was 'not_awaited' and its retry refused,
-- "its parent ... is COMPENSATION_FAILED, undoing its steps": the parent undoes nothing of the child, and
-- takes nothing of it whichever way its compensation ends (its child step was cancelled), so the refusal
-- only held the child back until the parent's saga ended, for as long as that took
-- (tests/sagas/test_cancel.py, test_a_detached_child_of_a_parent_whose_compensation_stopped_is_retried_as_
-- its_own printed "stepstone.errors.ChildNotAwaited: instance ... is not retried: its parent ... is
-- COMPENSATION_FAILED, undoing its steps"). Such a child is now 'abandoned' too; its report reaches the
-- parent's cancelled position and is ignored (CALLBACK_IGNORED). A child whose own failure took its parent
-- into compensation (its step failed there, not cancelled) is still not awaited, detached or not.

CREATE OR REPLACE FUNCTION {{schema}}.child_standing(p_child {{schema}}.instances)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p.status IN ('PENDING', 'RUNNING', 'WAITING', 'FAILED')
             AND (x.status IN ('RUNNING', 'WAITING') OR x.status = 'FAILED' AND p.status = 'FAILED')
        THEN 'awaited'
        WHEN NOT p_child.cancel_with_parent AND x.status = 'CANCELLED'
             AND ({{schema}}.is_terminal(p.status) OR p.status IN ('COMPENSATING', 'COMPENSATION_FAILED'))
        THEN 'abandoned'
        ELSE 'not_awaited' END
    FROM (SELECT 1) AS one
    LEFT JOIN {{schema}}.instances p ON p.id = p_child.parent_id
    LEFT JOIN {{schema}}.positions x ON x.instance_id = p.id AND x.path = COALESCE(p_child.parent_position, '')
                                    AND x.visit = p_child.parent_visit
$$;

CREATE OR REPLACE FUNCTION {{schema}}.record_open_children(p_instance uuid, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT p_instance, t.path, t.step, t.visit, t.recorded, p_now
    FROM (
        SELECT 1 AS part, c.id, x.path, x.step, x.visit, jsonb_build_object('kind', 'child', 'child_id', c.id)
               AS recorded
        FROM {{schema}}.positions x
        JOIN {{schema}}.instances c ON c.id = (x.wait->>'child_id')::uuid
        WHERE x.instance_id = p_instance AND x.status = 'WAITING' AND x.wait->>'kind' = 'child'
          AND c.parent_id = p_instance AND c.status = 'COMPLETED' AND c.cancel_with_parent
          AND COALESCE(c.parent_position, '') = x.path AND c.parent_visit = x.visit
          AND EXISTS (SELECT 1 FROM {{schema}}.commands r
                      WHERE r.instance_id = p_instance AND r.position = x.path AND r.kind = 'CHILD_COMPLETION'
                        AND (r.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')) IS TRUE
                        AND r.visit = x.visit AND r.payload->>'child_id' = c.id::text
                        AND r.payload->>'status' = 'COMPLETED')
          AND EXISTS (SELECT 1 FROM {{schema}}.instances i
                      JOIN {{schema}}.definitions d ON d.scope IN (i.definition_scope, i.scope)
                           AND d.definition_id = i.definition_id AND d.version = i.version
                           AND d.plan_hash = i.plan_hash
                      CROSS JOIN LATERAL jsonb_array_elements(d.plan->'steps') AS s
                      WHERE i.id = p_instance AND s ? 'compensation')
        UNION ALL
        SELECT 2, c.id, coalesce(c.parent_position, ''),
               coalesce((SELECT p.step FROM {{schema}}.positions p
                         WHERE p.instance_id = p_instance AND p.path = coalesce(c.parent_position, '')
                           AND p.visit = c.parent_visit), c.definition_id),
               coalesce(c.parent_visit, 0), jsonb_build_object('kind', 'child', 'child_id', c.id, 'open', true)
        FROM {{schema}}.instances c
        WHERE c.parent_id = p_instance AND c.cancel_with_parent AND c.ended_at IS NULL
    ) AS t
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.compensations k
                      WHERE k.instance_id = p_instance AND k.recorded->>'kind' = 'child'
                        AND k.recorded->>'child_id' = t.id::text)
    ORDER BY t.part, t.id;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.saga_begin(p_instance uuid, p_cause text, p_reason text, p_actor text,
                                                 p_now timestamptz, p_keep text, p_record bigint DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    -- The children it takes over, first, while the positions still wait (record_open_children, version 90).
    PERFORM {{schema}}.record_open_children(p_instance, p_now);
    PERFORM {{schema}}.close_positions(p_instance, p_now, p_keep, true);
    PERFORM {{schema}}.open_saga_position(p_instance, p_now);
    PERFORM {{schema}}.settle_open_commands(p_instance, coalesce(p_reason, 'compensating: ' || p_cause), p_actor,
                                            p_now);
    -- (A completed child its parent compensates is reopened: ended_at is cleared.)
    UPDATE {{schema}}.instances i SET branches = 0, wait = NULL, updated_at = p_now, ended_at = NULL,
        saga = jsonb_strip_nulls(jsonb_build_object('cause', p_cause, 'reason', p_reason, 'actor', p_actor,
                                                    'at', p_now, 'record', p_record))
    WHERE i.id = p_instance;
    -- A step whose compensation an earlier round gave up (then a replay went on) is still not undone.
    PERFORM {{schema}}.saga_owe_given_up(p_instance);
    RETURN {{schema}}.saga_next(p_instance, p_now, p_actor);
END $$;
