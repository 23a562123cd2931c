-- Sagas, second part (core/saga.py): a child its parent's saga finds still running is compensated,
-- not cancelled, and a step deadline on any kind of step (a wait, a task, a child; the start step).
--
-- A running child: when the parent's saga begins, every child still open that goes with its parent
-- (cancel_with_parent) becomes a compensation of the parent, the newest (it is what the parent was
-- doing last), so it is undone first: its COMPENSATE asks the child to cancel with compensation (its
-- positions close and lose their leases, its completed steps are compensated in its own reverse
-- order) and the parent's saga waits on '$saga' until the child reports how that ended. A child
-- already compensating on its own is asked only to report. Who reports to a parent's saga is now
-- marked by `saga.record` (the parent's compensation the child answers), not by the cause 'parent'.
--
-- Lock order as in 0006: the parent's instance row (taken by its commit) -> its positions -> its
-- commands -> the child's instance row -> the child's positions and commands -> compensations ->
-- history. A child never waits on its parent's rows: it reports by inserting a command.

CREATE OR REPLACE FUNCTION {{schema}}.tell_parent(p_child {{schema}}.instances, p_status text, p_message text,
                                                  p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_for_saga boolean := coalesce(p_child.saga ? 'record', false);
BEGIN
    IF p_child.parent_id IS NULL THEN
        RETURN;
    END IF;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                     created_at)
    VALUES (p_child.parent_id, CASE WHEN v_for_saga THEN '$saga' ELSE COALESCE(p_child.parent_position, '') END,
            nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION', 'PENDING',
            CASE WHEN v_for_saga THEN 1 ELSE p_child.parent_visit END,
            jsonb_build_object('child_id', p_child.id, 'status', p_status,
                               'error', jsonb_build_object('type', initcap(p_status), 'message', p_message))
            || CASE WHEN v_for_saga THEN (SELECT jsonb_build_object('record', k.id, 'step', k.step, 'visit', k.visit)
                                          FROM {{schema}}.compensations k
                                          WHERE k.id = (p_child.saga->>'record')::bigint)
                    ELSE '{}'::jsonb END,
            p_now, p_now);
END $$;

-- The children still open that go with their parent become the parent's newest compensations (in
-- ascending child id order, so the highest id is undone first).
CREATE FUNCTION {{schema}}.record_open_children(p_instance uuid, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT p_instance, coalesce(c.parent_position, ''),
           coalesce((SELECT p.step FROM {{schema}}.positions p
                     WHERE p.instance_id = p_instance AND p.path = coalesce(c.parent_position, '')
                       AND p.visit = c.parent_visit), c.definition_id),
           coalesce(c.parent_visit, 0),
           jsonb_build_object('kind', 'child', 'child_id', c.id, 'open', true), p_now
    FROM {{schema}}.instances c
    WHERE c.parent_id = p_instance AND c.cancel_with_parent AND c.ended_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.compensations k
                      WHERE k.instance_id = p_instance AND k.recorded->>'kind' = 'child'
                        AND k.recorded->>'child_id' = c.id::text)
    ORDER BY c.id;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.saga_begin(p_instance uuid, p_cause text, p_reason text, p_actor text,
                                                 p_now timestamptz, p_keep text, p_record bigint DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM {{schema}}.close_positions(p_instance, p_now, p_keep, true);
    PERFORM {{schema}}.open_saga_position(p_instance, p_now);
    PERFORM {{schema}}.settle_open_commands(p_instance, coalesce(p_reason, 'compensating: ' || p_cause), p_actor,
                                            p_now);
    -- (A completed child its parent compensates is reopened: ended_at is cleared.)
    UPDATE {{schema}}.instances i SET branches = 0, wait = NULL, updated_at = p_now, ended_at = NULL,
        saga = jsonb_strip_nulls(jsonb_build_object('cause', p_cause, 'reason', p_reason, 'actor', p_actor,
                                                    'at', p_now, 'record', p_record))
    WHERE i.id = p_instance;
    PERFORM {{schema}}.record_open_children(p_instance, p_now);
    RETURN {{schema}}.saga_next(p_instance, p_now, p_actor);
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.compensate_child(p_child uuid, p_record bigint, p_actor text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_child {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_child FROM {{schema}}.instances i WHERE i.id = p_child FOR UPDATE;
    IF v_child.status IN ('COMPLETED', 'PENDING', 'RUNNING', 'WAITING', 'FAILED') THEN
        -- Completed, or still open: cancel with compensation (a running handler's commit is refused).
        PERFORM {{schema}}.saga_begin(p_child, 'parent', 'the parent compensates', p_actor, p_now, NULL, p_record);
    ELSIF v_child.status = 'COMPENSATING' THEN
        -- It compensates on its own already: it reports to this saga when it ends.
        UPDATE {{schema}}.instances i SET saga = i.saga || jsonb_build_object('record', p_record)
        WHERE i.id = p_child;
    ELSIF v_child.status = 'COMPENSATION_FAILED' THEN
        UPDATE {{schema}}.instances i SET saga = i.saga || jsonb_build_object('record', p_record), error = NULL
        WHERE i.id = p_child;
        UPDATE {{schema}}.positions p SET status = 'SAGA' WHERE p.instance_id = p_child AND p.path = '$saga';
        UPDATE {{schema}}.compensations k SET status = 'PENDING'
        WHERE k.id IN (SELECT y.id FROM {{schema}}.compensations y
                       WHERE y.instance_id = p_child AND y.status = 'FAILED' ORDER BY y.id FOR UPDATE);
        PERFORM {{schema}}.saga_next(p_child, p_now, p_actor);
    ELSE
        v_child.saga := jsonb_build_object('cause', 'parent', 'record', p_record);
        PERFORM {{schema}}.tell_parent(v_child, COALESCE(v_child.status, 'MISSING'), 'the child had ended', p_now);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.saga_next(p_instance uuid, p_now timestamptz, p_actor text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_inst {{schema}}.instances%ROWTYPE;
    v_rec {{schema}}.compensations%ROWTYPE;
    v_final text;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance;
    SELECT * INTO v_rec FROM {{schema}}.compensations k
    WHERE k.instance_id = p_instance AND k.status = 'PENDING' ORDER BY k.id DESC LIMIT 1 FOR UPDATE;
    IF FOUND THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, payload,
                                         available_at, created_at)
        VALUES (p_instance, '$saga', nextval('{{schema}}.command_seq'), 'COMPENSATE', 'PENDING', v_rec.step,
                v_rec.visit, jsonb_build_object('record', v_rec.id, 'step', v_rec.step, 'position', v_rec.position,
                                                'visit', v_rec.visit, 'recorded', v_rec.recorded,
                                                'cause', v_inst.saga->>'cause'),
                p_now, p_now);
        UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = p_instance;
        RETURN 'COMPENSATING';
    END IF;
    -- By why it compensated: a failure (or a parent's saga) undone, a cancel, a deadline.
    v_final := CASE v_inst.saga->>'cause' WHEN 'cancelled' THEN 'CANCELLED' WHEN 'timed_out' THEN 'TIMED_OUT'
                                          ELSE 'COMPENSATED' END;
    UPDATE {{schema}}.positions p SET status = 'COMPLETED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = p_now
    WHERE p.instance_id = p_instance AND p.path = '$saga';
    UPDATE {{schema}}.commands c SET state = 'REJECTED', token = NULL, settled_at = p_now,
        last_error = 'INSTANCE_ENDED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET status = v_final, wait = NULL, updated_at = p_now, ended_at = p_now
    WHERE i.id = p_instance;
    PERFORM {{schema}}.saga_history(
        p_instance, 'INSTANCE_' || v_final, NULL, NULL, NULL, NULL, p_actor,
        jsonb_build_object('cause', v_inst.saga->>'cause',
                           'compensated', (SELECT coalesce(jsonb_agg(k.step ORDER BY k.compensated_at, k.id), '[]')
                                           FROM {{schema}}.compensations k
                                           WHERE k.instance_id = p_instance AND k.status = 'COMPENSATED')),
        p_now);
    -- A child that timed out or was cancelled tells its parent (a failure told it when the step failed),
    -- and so does a child its parent's saga waits on.
    IF v_inst.saga->>'cause' <> 'failed' OR v_inst.saga ? 'record' THEN
        PERFORM {{schema}}.tell_parent(v_inst, v_final, coalesce(v_inst.saga->>'reason', v_final), p_now);
    END IF;
    RETURN v_final;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.advance_saga(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    v_actor text := p_commit->>'actor';
    x jsonb;
BEGIN
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        IF x->>'op' = 'begin' THEN
            PERFORM {{schema}}.saga_begin(v_id, x->>'cause', NULL, v_actor, p_now, p_commit->>'position');
            CONTINUE;
        ELSIF x->>'op' = 'compensate_child' THEN
            PERFORM {{schema}}.compensate_child((x->>'child')::uuid, (x->>'record')::bigint, v_actor, p_now);
            UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = v_id;
            CONTINUE;
        END IF;
        UPDATE {{schema}}.compensations k SET
            attempts = k.attempts + 1,
            status = CASE x->>'op' WHEN 'done' THEN 'COMPENSATED' WHEN 'exhausted' THEN 'FAILED' ELSE k.status END,
            last_error = CASE WHEN x->>'op' = 'done' THEN k.last_error ELSE x->'error' END,
            compensated_at = CASE WHEN x->>'op' = 'done' THEN p_now END
        WHERE k.id = (x->>'record')::bigint AND k.instance_id = v_id AND k.status = 'PENDING';
        IF NOT FOUND THEN
            RAISE EXCEPTION 'stepstone: compensation % of instance % is not pending', x->>'record', v_id
                USING ERRCODE = 'P0001';
        END IF;
        IF x->>'op' = 'done' THEN
            PERFORM {{schema}}.saga_next(v_id, p_now, v_actor);
        ELSIF x->>'op' = 'exhausted' THEN
            UPDATE {{schema}}.instances i SET status = 'COMPENSATION_FAILED', updated_at = p_now,
                error = jsonb_build_object('type', 'CompensationFailed', 'record', (x->>'record')::bigint,
                                           'error', x->'error', 'attempts', (x->>'attempts')::integer)
            WHERE i.id = v_id;
            IF (SELECT i.saga ? 'record' FROM {{schema}}.instances i WHERE i.id = v_id) THEN
                PERFORM {{schema}}.tell_parent(i, 'COMPENSATION_FAILED', x->'error'->>'message', p_now)
                FROM {{schema}}.instances i WHERE i.id = v_id;
            END IF;
        ELSE
            UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = v_id;
        END IF;
    END LOOP;
END $$;

-- Step deadlines on waits and timers too, and on the start step. A position interrupted at a wait or
-- a timer is left by its TIMER 'step_deadline' like a running one (core/saga.py).
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
            CONTINUE;  -- the step finished (or the position moved on) in time
        END IF;
        PERFORM {{schema}}.settle_open_commands(v_id, 'step deadline', p_commit->>'actor', p_now, x->>'position',
                                                ARRAY['START', 'STEP', 'RETRY'], 'STEP_DEADLINE');
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, available_at,
                                         created_at)
        VALUES (v_id, x->>'position', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', x->>'step',
                (x->>'visit')::integer, 'step_deadline', p_now, p_now);
    END LOOP;
END $$;

-- The start's timers, in the start's own statement: the instance deadline (schedule_deadline) and the
-- start step's deadline (`p_step` entered at visit 1 on the root position; its TIMER queues on '$saga'
-- like every step deadline). A repeated start (p_instance NULL) schedules nothing.
CREATE FUNCTION {{schema}}.schedule_start_deadlines(p_instance uuid, p_at timestamptz, p_seconds float8,
                                                    p_step text, p_step_seconds float8)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    PERFORM {{schema}}.schedule_deadline(p_instance, p_at, p_seconds);
    IF p_instance IS NULL OR p_step_seconds IS NULL THEN
        RETURN p_instance;
    END IF;
    PERFORM {{schema}}.open_saga_position(p_instance, v_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     available_at, created_at)
    VALUES (p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', p_step, 1, 'step_deadline',
            jsonb_build_object('position', '', 'step', p_step, 'visit', 1),
            v_now + make_interval(secs => p_step_seconds), v_now);
    RETURN p_instance;
END $$;

-- An instance that completed or was cancelled keeps that status. A late command on one of its
-- positions (a detached child reporting to a cancelled parent, say) commits a status derived from
-- its live positions, and with none live that derivation reads WAITING. What reopens an ended
-- instance on purpose clears its ended_at in the same update: a replay (replay_instance) or a saga
-- (a completed child its parent compensates, which also marks the row `saga` first, so the saga's
-- own trigger decides from then on). A commit never clears ended_at.
CREATE TRIGGER instances_keep_ended_status
    BEFORE UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (OLD.saga IS NULL AND OLD.status IN ('COMPLETED', 'CANCELLED')
                       AND OLD.status IS DISTINCT FROM NEW.status
                       AND NEW.ended_at IS NOT DISTINCT FROM OLD.ended_at)
    EXECUTE FUNCTION {{schema}}.keep_saga_status();
