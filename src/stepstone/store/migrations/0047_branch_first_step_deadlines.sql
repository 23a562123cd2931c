-- Step deadlines on the first step of a fork's branches (docs/sagas.md, "Step deadlines"). A branch's
-- first step is not entered: open_branches queues its STEP command, which runs an action's handler at
-- once, so nothing scheduled that action's deadline and it was never enforced. The fork's commit now
-- names each such branch in its 'step_deadlines' section ('position', core/entering.py), without a
-- visit: a fork that runs again reopens its branches at their next visit, which is read here from the
-- row open_branches wrote earlier in the same commit (section 3 of commit_decision runs before the
-- feature sections). An item without 'position' is the committing position's step at its 'visit', as
-- before, so a worker of before is served unchanged.
-- Expand only: a function replaced, same signature.
CREATE OR REPLACE FUNCTION {{schema}}.schedule_step_deadlines(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
BEGIN
    PERFORM {{schema}}.open_saga_position(v_id, p_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     available_at, created_at)
    SELECT v_id, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', x->>'step', t.visit,
           'step_deadline', jsonb_build_object('position', t.path, 'step', x->>'step', 'visit', t.visit),
           p_now + make_interval(secs => (x->>'seconds')::float8), p_now
    FROM jsonb_array_elements(p_items) AS x
    CROSS JOIN LATERAL (
        -- A branch the commit opened: the visit open_branches gave it (1, or the next on a fork's rerun).
        SELECT COALESCE(x->>'position', p_commit->>'position') AS path,
               COALESCE((x->>'visit')::integer,
                        (SELECT p.visit FROM {{schema}}.positions p
                         WHERE p.instance_id = v_id AND p.path = x->>'position' AND p.step = x->>'step'
                           AND p.status = 'RUNNING')) AS visit
    ) AS t
    WHERE t.visit IS NOT NULL;
END $$;
