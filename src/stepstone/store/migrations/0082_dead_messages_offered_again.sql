-- A retry offers a dead-lettered message again, to the wait it was delivered to.
--
-- A message whose MESSAGE command crashed its workers until it was dead-lettered (a poison command) fails its
-- wait: the position FAILED with its wait kept, the instance FAILED, the wait's subscription used by the
-- message. retry_instance superseded every dead command but a signal (RETRIED) and queued a RETRY that entered
-- the wait again: the message, answered `delivered` to that instance, was never applied, stayed DELIVERED with
-- a superseded command, and the wait opened anew and waited for another message (took the next one published,
-- or one buffered meanwhile, in its place: tests/engine/test_failed_waits.py,
-- test_a_dead_lettered_message_is_offered_again_by_the_retry printed "('COMPLETED', [8]) == ('COMPLETED', [7])").
-- A dead signal was offered again; a dead message is now too. A failed position whose dead MESSAGE command is
-- of its current step and visit waits again as it was, without a RETRY (its subscription still used, so no
-- other message is given to it while its own is on its way), and the command is PENDING again: the wait takes
-- it once. Any other dead message (of a visit its position has left) is PENDING again and applied as a message
-- that finds its wait left is (parked, or, taken from the buffer, handed on). Such a wait's step deadline is
-- counted from the retry, as a retried step's is.
-- Expand only: retry_instance replaced with the same signature.

CREATE OR REPLACE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_paths text[];
    v_timer bigint;
    v_plan jsonb;
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
    -- A wait whose message's command was dead-lettered failed there with its wait kept (core/transitions.py,
    -- _dead_letter), its subscription used by that message. A RETRY entered the wait again and the dead command
    -- was superseded: the message, delivered to this instance, was never applied, and the wait opened anew for
    -- another (version 82). Such a wait waits again as it was (its subscription still used, so no other message
    -- is given to it) and its dead message is offered to it again below; every other failed position runs its
    -- failed step again (RETRY).
    WITH failed AS (
        UPDATE {{schema}}.positions p SET
            status = CASE WHEN p.wait IS NOT NULL
                               AND EXISTS (SELECT 1 FROM {{schema}}.commands m
                                           WHERE m.instance_id = p.instance_id AND m.state = 'DEAD'
                                             AND m.kind = 'MESSAGE' AND m.position = p.path AND m.step = p.step
                                             AND m.visit = p.visit)
                          THEN 'WAITING' ELSE 'RUNNING' END,
            error = NULL, updated_at = v_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND x.status = 'FAILED'
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path, p.step, p.visit, p.status
    ), queued AS (
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                         created_at)
        SELECT p_instance, failed.path, nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', failed.step,
               failed.visit, v_now, v_now
        FROM failed WHERE failed.status = 'RUNNING' ORDER BY failed.path
        RETURNING id
    )
    SELECT COALESCE(array_agg(failed.path), '{}') INTO v_paths FROM failed;  -- (queued runs unread)
    -- Each retried step's deadline, counted from now: the pending timers of those positions' steps are
    -- superseded (ascending id) and new ones queued. The positions just retried say which steps.
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   JOIN {{schema}}.positions r ON r.instance_id = p_instance AND r.path = ANY (v_paths)
                        AND r.path = x.payload->>'position' AND r.step = x.step
                   WHERE x.instance_id = p_instance AND x.position = '$saga' AND x.kind = 'TIMER'
                     AND x.name = 'step_deadline' AND (x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE
                   ORDER BY x.id FOR UPDATE OF x);
    -- The deadlines of the plan the instance runs (its plan hash), in the registration its pin was admitted
    -- against or in its own scope (registered there after it started): none known when it is not stored.
    SELECT d.plan INTO v_plan FROM {{schema}}.definitions d
    WHERE d.scope IN (v_inst.definition_scope, v_inst.scope) AND d.definition_id = v_inst.definition_id
      AND d.version = v_inst.version AND d.plan_hash = v_inst.plan_hash
    ORDER BY d.scope = v_inst.definition_scope DESC LIMIT 1;
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(v_plan->'steps') AS s WHERE s ? 'deadline') THEN
        PERFORM {{schema}}.open_saga_position(p_instance, v_now);
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                         available_at, created_at)
        SELECT p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', r.step, r.visit,
               'step_deadline', jsonb_build_object('position', r.path, 'step', r.step, 'visit', r.visit),
               v_now + make_interval(secs => (s->'deadline'->>'seconds')::float8), v_now
        FROM {{schema}}.positions r
        CROSS JOIN LATERAL jsonb_array_elements(v_plan->'steps') AS s
        WHERE r.instance_id = p_instance AND r.path = ANY (v_paths) AND s->>'name' = r.step AND s ? 'deadline'
        ORDER BY r.path;
    END IF;
    -- A dead message is offered again as a dead signal is (version 82; it was superseded, and lost): to the
    -- wait it was delivered to when that wait waits again (above), else applied as any message that finds its
    -- wait left (parked, or, taken from the buffer, handed on).
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind NOT IN ('SIGNAL', 'MESSAGE')
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.commands c SET state = 'PENDING', claims = 0, available_at = v_now, token = NULL
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind IN ('SIGNAL', 'MESSAGE')
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET status = 'RUNNING', error = NULL,
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_RETRIED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('error', v_inst.error, 'positions', cardinality(v_paths)));
    RETURN QUERY SELECT 'retried', 'RUNNING'::text;
END $$;
