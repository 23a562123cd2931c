-- Compensations given up are owed again by every later round of a saga (docs/sagas.md, "When a
-- compensation keeps failing").
--
-- A compensation that gave up leaves its record FAILED. `stepstone retry` and a parent that compensates
-- such a child set it PENDING again (two copies of one statement); a new round begun by saga_begin did
-- not: a COMPENSATION_FAILED saga replayed from its failed step that failed again passed over the step
-- whose compensation was given up and ended COMPENSATED with that step never undone and no alert. The
-- statement is now one function, saga_owe_given_up, which the three call.
-- Expand only: a function added, three replaced with the same signatures (and advance_saga, below).

-- The compensations of an instance given up (FAILED) are owed again (PENDING), in ascending id order.
CREATE FUNCTION {{schema}}.saga_owe_given_up(p_instance uuid)
RETURNS void
LANGUAGE sql AS $$
    UPDATE {{schema}}.compensations k SET status = 'PENDING'
    WHERE k.id IN (SELECT y.id FROM {{schema}}.compensations y
                   WHERE y.instance_id = p_instance AND y.status = 'FAILED' ORDER BY y.id FOR UPDATE);
$$;

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
    -- A step whose compensation an earlier round gave up (then a replay went on) is still not undone.
    PERFORM {{schema}}.saga_owe_given_up(p_instance);
    RETURN {{schema}}.saga_next(p_instance, p_now, p_actor);
END $$;

-- Retry: a COMPENSATION_FAILED instance resumes its compensation at the one given up (from its first
-- attempt); anything else goes to retry_instance.
CREATE OR REPLACE FUNCTION {{schema}}.retry_saga(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF FOUND AND v_inst.status = 'COMPENSATION_FAILED' THEN
        UPDATE {{schema}}.positions p SET status = 'SAGA', lease_token = NULL, lease_until = NULL,
            lease_owner = NULL, updated_at = v_now
        WHERE p.instance_id = p_instance AND p.path = '$saga';
        PERFORM {{schema}}.saga_owe_given_up(p_instance);
        UPDATE {{schema}}.instances i SET error = NULL WHERE i.id = p_instance;
        PERFORM {{schema}}.saga_history(p_instance, 'INSTANCE_RETRIED', NULL, NULL, NULL, NULL, p_actor,
                                        jsonb_build_object('error', v_inst.error, 'compensation', true), v_now);
        RETURN QUERY SELECT 'retried', {{schema}}.saga_next(p_instance, v_now, p_actor);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM {{schema}}.retry_instance(p_instance, p_actor);
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
        PERFORM {{schema}}.saga_owe_given_up(p_child);
        PERFORM {{schema}}.saga_next(p_child, p_now, p_actor);
    ELSE
        v_child.saga := jsonb_build_object('cause', 'parent', 'record', p_record);
        PERFORM {{schema}}.tell_parent(v_child, COALESCE(v_child.status, 'MISSING'), 'the child had ended', p_now);
    END IF;
END $$;

-- A saga stopped at COMPENSATION_FAILED says in its error which step's compensation gave up and why.
-- The error held the compensation record's id and, nested, the last error, with no `message` and no
-- `step`: `stepstone show` printed "CompensationFailed:" and nothing else. advance_saga now adds both
-- (the fields it had are kept).
CREATE OR REPLACE FUNCTION {{schema}}.advance_saga(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    v_actor text := p_commit->>'actor';
    v_step text;
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
        WHERE k.id = (x->>'record')::bigint AND k.instance_id = v_id AND k.status = 'PENDING'
        RETURNING k.step INTO v_step;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'stepstone: compensation % of instance % is not pending', x->>'record', v_id
                USING ERRCODE = 'P0001';
        END IF;
        IF x->>'op' = 'done' THEN
            PERFORM {{schema}}.saga_next(v_id, p_now, v_actor);
        ELSIF x->>'op' = 'exhausted' THEN
            UPDATE {{schema}}.instances i SET status = 'COMPENSATION_FAILED', updated_at = p_now,
                error = jsonb_build_object(
                    'type', 'CompensationFailed', 'step', v_step,
                    'message', format('the compensation of step %L gave up after %s attempt%s: %s: %s', v_step,
                                      x->>'attempts', CASE WHEN x->>'attempts' = '1' THEN '' ELSE 's' END,
                                      x->'error'->>'type', x->'error'->>'message'),
                    'record', (x->>'record')::bigint, 'error', x->'error', 'attempts', (x->>'attempts')::integer)
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
