-- A step deadline's STEP_DEADLINE_PASSED is recorded only when the deadline interrupts its step (docs/sagas.md,
-- "Step deadlines").
--
-- A step deadline's timer fires on '$saga' whether or not its step visit is still running: a step that
-- committed in time leaves the timer pending while the instance goes on (it is settled only when the
-- instance ends). When it fired after the step had been left, the core's decision recorded
-- STEP_DEADLINE_PASSED before the store found that the position had moved on, and then nothing else
-- happened: the history said a deadline passed for a visit that made it in time (seen in
-- tests/chaos/test_deadline_kills.py, where it was counted and reported). Now the core does not claim it:
-- interrupt_steps writes the entry (same kind, step, visit, data, position, command and actor) only for a
-- position it interrupts, before the COMMAND_CANCELLED entries of the step's commands, as before.
-- Expand only: interrupt_steps replaced with the same signature.

-- Step deadlines on waits and timers too, and on the start step. A position interrupted at a wait or
-- a timer is left by its TIMER 'step_deadline' like a running one (core/saga.py). STEP_DEADLINE_PASSED
-- is recorded only for a position interrupted (migration 0056).
CREATE OR REPLACE FUNCTION {{schema}}.interrupt_steps(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    x jsonb;
BEGIN
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL,
            updated_at = p_now
        WHERE p.instance_id = v_id AND p.path = x->>'position' AND p.step = x->>'step'
          AND p.visit = (x->>'visit')::integer AND p.status IN ('RUNNING', 'WAITING');
        IF NOT FOUND THEN
            CONTINUE;  -- the step finished (or the position moved on) in time: nothing to record
        END IF;
        -- Written here, where the interrupt applies, not by the core, which cannot know (migration 0056).
        PERFORM {{schema}}.saga_history(v_id, 'STEP_DEADLINE_PASSED', x->>'step', (x->>'visit')::integer,
                                        p_commit->>'position', (p_commit->>'command')::bigint, p_commit->>'actor',
                                        jsonb_build_object('position', x->>'position'), p_now);
        PERFORM {{schema}}.settle_open_commands(v_id, 'step deadline', p_commit->>'actor', p_now, x->>'position',
                                                ARRAY['START', 'STEP', 'RETRY'], 'STEP_DEADLINE');
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, available_at,
                                         created_at)
        VALUES (v_id, x->>'position', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', x->>'step',
                (x->>'visit')::integer, 'step_deadline', p_now, p_now);
    END LOOP;
END $$;
