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
        WHEN p.status IN ('PENDING', 'RUNNING', 'WAITING', 'FAILED') AND x.status IN ('RUNNING', 'WAITING', 'FAILED')
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
