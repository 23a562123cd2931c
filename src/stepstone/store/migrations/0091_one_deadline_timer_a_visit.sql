-- One step deadline timer a step visit. The retry of a wait or timer step that failed at its step deadline
-- (no on_deadline) queues the step's deadline anew, counted from the retry (retry_instance), and queues the
-- position's RETRY, which enters the step again at the same visit (core/transitions.py, _run_current_step):
-- entering a step with a deadline asks for its timer too (core/entering.py), so the visit had two. Both
-- fired at the deadline, each queuing a TIMER on the position; one failed it again, the other stayed open
-- there, and after the next retry a signal to the wait, well within its new deadline, was taken for one
-- coming after the deadline (the commit's `late` lookup found that TIMER) and parked for good
-- (tests/engine/test_branch_deadline_reports.py, test_a_wait_retried_after_its_deadline_gets_one_deadline_timer
-- printed "assert 2 == 1"). schedule_step_deadlines now queues none for a step visit (position, step,
-- visit) that has one open, whatever asked for it first.
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
    WHERE t.visit IS NOT NULL
      -- One timer a step visit: a retry of a wait or timer failed at its deadline queues its deadline anew,
      -- and its RETRY, entering the step again at that visit, asked for it again (version 91).
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.commands y
                      WHERE y.instance_id = v_id AND y.position = '$saga' AND y.kind = 'TIMER'
                        AND y.name = 'step_deadline' AND y.step = x->>'step' AND y.visit = t.visit
                        AND y.payload->>'position' = t.path
                        AND (y.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE);
END $$;
