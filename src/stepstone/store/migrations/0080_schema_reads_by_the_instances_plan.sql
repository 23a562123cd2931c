-- The schema functions read the plan an instance runs: its definition scope's row, and its own plan hash.
--
-- retry_instance queued each retried step's deadline timer from the registry row of (instance scope, id,
-- version). An instance of a scope with no registration of its own runs the default scope's registration
-- (definition_scope 'default', set by the pin admission; migration 0008): no row matched its own scope, so
-- an operator's retry queued no deadline timer and the retried step ran unbounded
-- (tests/sagas/test_failed_deadline.py). It reads the definition scope's row now.
-- Expand only: retry_instance replaced with the same signature.
CREATE OR REPLACE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_retries bigint[];
    v_timer bigint;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    IF v_inst.status <> 'FAILED' THEN
        RETURN QUERY SELECT 'not_failed', v_inst.status;
        RETURN;
    END IF;
    -- The instance deadline passed while it was FAILED and its timer has not fired: it fires here, as a
    -- worker's claim would have fired it (core/saga.py, _deadline).
    SELECT c.id INTO v_timer FROM {{schema}}.commands c
    WHERE c.instance_id = p_instance AND c.position = '$saga' AND c.kind = 'TIMER' AND c.name = 'deadline'
      AND ((c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND c.available_at <= v_now
           OR (c.state = 'CLAIMED') IS TRUE)  -- claimed: it was due; a worker's late commit is refused
    ORDER BY c.id LIMIT 1 FOR UPDATE;
    IF FOUND THEN
        UPDATE {{schema}}.commands c SET state = 'COMPLETE', token = NULL, settled_at = v_now
        WHERE c.id = v_timer;
        PERFORM {{schema}}.saga_history(p_instance, 'DEADLINE_PASSED', NULL, NULL, '$saga', v_timer, p_actor,
                                        jsonb_build_object('cause', 'timed_out', 'status_before', 'FAILED',
                                                           'outcome', 'left FAILED for an operator'), v_now);
        SELECT i.history_seq INTO v_inst.history_seq FROM {{schema}}.instances i WHERE i.id = p_instance;
    END IF;
    WITH failed AS (
        UPDATE {{schema}}.positions p SET status = 'RUNNING', error = NULL, updated_at = v_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND x.status = 'FAILED'
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path, p.step, p.visit
    ), queued AS (
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                         created_at)
        SELECT p_instance, failed.path, nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', failed.step,
               failed.visit, v_now, v_now
        FROM failed ORDER BY failed.path
        RETURNING id
    )
    SELECT COALESCE(array_agg(queued.id), '{}') INTO v_retries FROM queued;
    -- Each retried step's deadline, counted from now: the pending timers of those positions' steps are
    -- superseded (ascending id) and new ones queued. The RETRY commands just queued name the positions.
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   JOIN {{schema}}.commands r ON r.id = ANY (v_retries)
                        AND r.position = x.payload->>'position' AND r.step = x.step
                   WHERE x.instance_id = p_instance AND x.position = '$saga' AND x.kind = 'TIMER'
                     AND x.name = 'step_deadline' AND (x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE
                   ORDER BY x.id FOR UPDATE OF x);
    IF EXISTS (SELECT 1 FROM {{schema}}.definitions d, jsonb_array_elements(d.plan->'steps') AS s
               WHERE d.scope = v_inst.definition_scope AND d.definition_id = v_inst.definition_id
                 AND d.version = v_inst.version AND s ? 'deadline') THEN
        PERFORM {{schema}}.open_saga_position(p_instance, v_now);
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                         available_at, created_at)
        SELECT p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', r.step, r.visit,
               'step_deadline', jsonb_build_object('position', r.position, 'step', r.step, 'visit', r.visit),
               v_now + make_interval(secs => (s->'deadline'->>'seconds')::float8), v_now
        FROM {{schema}}.commands r
        JOIN {{schema}}.definitions d ON d.scope = v_inst.definition_scope AND d.definition_id = v_inst.definition_id
             AND d.version = v_inst.version
        CROSS JOIN LATERAL jsonb_array_elements(d.plan->'steps') AS s
        WHERE r.id = ANY (v_retries) AND s->>'name' = r.step AND s ? 'deadline'
        ORDER BY r.position;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind <> 'SIGNAL'
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.commands c SET state = 'PENDING', claims = 0, available_at = v_now, token = NULL
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind = 'SIGNAL'
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET status = 'RUNNING', error = NULL,
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_RETRIED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('error', v_inst.error, 'positions', cardinality(v_retries)));
    RETURN QUERY SELECT 'retried', 'RUNNING'::text;
END $$;
