-- A child's retry whose parent no longer awaits it is refused; a parent's replay while a child it awaits is
-- under way is refused.
--
-- A parent replayed (to a new visit) while its FAILED child was retried went on with the new child its
-- replay started; the old child ran its retry to its end, and its report, which the parent no longer
-- waited for, was settled REJECTED (CHILD_NOT_AWAITED): nothing applied twice, but the child's steps ran
-- in both children, so the outside world saw its effects twice. A retry of a child whose parent had
-- taken on_failure, ended, compensated or closed its branch likewise ran the child for a result nothing
-- took. retry_instance now refuses a FAILED child whose parent no longer awaits it (outcome not_awaited;
-- child_standing below says when a parent awaits a child), and nothing changes; a child started with
-- cancel_with_parent false whose parent ended at that step is abandoned and is still retried, as an
-- instance of its own. replay_instance refuses a parent that awaits a child still under way (PENDING,
-- RUNNING, WAITING: a retried one, or a branch's child while another branch failed) with outcome
-- child_live: a replay would leave that child running for a result nothing takes, beside the new child
-- the step starts when it runs again; the operator waits for the child to end (then retries the parent,
-- which goes on with its result) or cancels it first.
--
-- Concurrent, the two are decided exactly: replay_instance takes the parent's row, its positions, the
-- commands it supersedes and then its children that have not ended for good (ascending id), the lock
-- order, before it writes anything. A retry of the child locks the child's row and then reads the
-- parent: one that waited for a replay's lock reads the parent moved on and is refused; a replay that
-- waited for a retry's lock sees the child running and is refused. The child never waits on its
-- parent's rows.

-- Where a child stands with its parent: 'awaited' while the parent's position that started it is still at
-- that step visit and waits, runs or failed there, in a parent that has not ended or begun to compensate
-- (retried, it goes on with the child's result); 'abandoned' when the parent ended with that position
-- cancelled at that visit and the child was started with cancel_with_parent false (it runs on as an
-- instance of its own); else 'not_awaited' (the parent moved on: replayed, took on_failure, ended,
-- compensates, closed the child's branch, or no longer exists).
CREATE FUNCTION {{schema}}.child_standing(p_child {{schema}}.instances)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p.status IN ('PENDING', 'RUNNING', 'WAITING', 'FAILED') AND x.status IN ('RUNNING', 'WAITING', 'FAILED')
        THEN 'awaited'
        WHEN NOT p_child.cancel_with_parent AND {{schema}}.is_terminal(p.status) AND x.status = 'CANCELLED'
        THEN 'abandoned'
        ELSE 'not_awaited' END
    FROM (SELECT 1) AS one
    LEFT JOIN {{schema}}.instances p ON p.id = p_child.parent_id
    LEFT JOIN {{schema}}.positions x ON x.instance_id = p.id AND x.path = COALESCE(p_child.parent_position, '')
                                    AND x.visit = p_child.parent_visit
$$;

-- What a refused retry of a child says of its parent: the parent's status, the position that started the
-- child as it is now (status, step, visit), the visit that started the child, the child the position
-- awaits (or started) at its current visit, and the child's own step (the one a replay of it would name).
CREATE FUNCTION {{schema}}.parent_of_child(p_child uuid)
RETURNS TABLE (parent_id uuid, parent_status text, parent_position text, position_status text,
               position_step text, position_visit integer, child_visit integer, awaits uuid, child_step text)
LANGUAGE sql STABLE AS $$
    SELECT c.parent_id, p.status, COALESCE(c.parent_position, ''), x.status, x.step, x.visit, c.parent_visit,
           CASE WHEN x.wait->>'kind' = 'child' THEN (x.wait->>'child_id')::uuid
                ELSE (SELECT k.id FROM {{schema}}.instances k
                      WHERE k.parent_id = c.parent_id AND COALESCE(k.parent_position, '') = x.path
                        AND k.parent_visit = x.visit AND k.id <> c.id
                      ORDER BY k.id LIMIT 1) END,
           c.step
    FROM {{schema}}.instances c
    LEFT JOIN {{schema}}.instances p ON p.id = c.parent_id
    LEFT JOIN {{schema}}.positions x ON x.instance_id = p.id AND x.path = COALESCE(c.parent_position, '')
    WHERE c.id = p_child
$$;

-- retry_instance: a child whose parent no longer awaits it is refused (outcome not_awaited).
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
    -- A child whose parent no longer awaits it (child_standing, version 83) is refused, and nothing changes:
    -- its steps would run again for a result nothing takes, beside what the parent went on with. Its
    -- parent's rows are read, not locked (a child never waits on its parent's rows): a replay of the
    -- parent locks this row before it writes, so this reads the parent as that replay left it.
    IF v_inst.parent_id IS NOT NULL AND {{schema}}.child_standing(v_inst) = 'not_awaited' THEN
        RETURN QUERY SELECT 'not_awaited', v_inst.status;
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

-- replay_instance: the children locked before any write; a live child the parent awaits refuses it (outcome
-- child_live).
CREATE OR REPLACE FUNCTION {{schema}}.replay_instance(p_instance uuid, p_step text, p_state jsonb, p_baseline jsonb,
                                           p_expected_seq integer, p_from_seq integer, p_actor text)
RETURNS TABLE (outcome text, status text, visit integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_visit integer;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text, NULL::integer;
        RETURN;
    END IF;
    IF v_inst.status IN ('PENDING', 'RUNNING', 'WAITING', 'COMPENSATING') THEN
        RETURN QUERY SELECT 'active', v_inst.status, NULL::integer;
        RETURN;
    END IF;
    IF v_inst.history_seq <> p_expected_seq THEN
        RETURN QUERY SELECT 'changed', v_inst.status, NULL::integer;
        RETURN;
    END IF;
    -- Positions (ascending path): branches closed, the root taken over with a fresh visit.
    PERFORM 1 FROM {{schema}}.positions p WHERE p.instance_id = p_instance ORDER BY p.path FOR UPDATE;
    -- Then the commands it supersedes (ascending id) and its children that have not ended for good (ascending
    -- id): the lock order, before anything is written. A retry of a FAILED child waits here and then finds
    -- its parent moved on (retry_instance); a child retried first is seen running. A child still under way
    -- (PENDING, RUNNING, WAITING) that a position of this instance awaits refuses the replay (outcome
    -- child_live; version 83): the replay would leave it running for a result nothing takes, beside the
    -- new child its step starts when it runs again.
    PERFORM 1 FROM {{schema}}.commands x
    WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'DEAD')
      AND NOT (x.kind = 'SIGNAL' AND x.state <> 'CLAIMED')
    ORDER BY x.id FOR UPDATE;
    PERFORM 1 FROM {{schema}}.instances x
    WHERE x.parent_id = p_instance AND NOT {{schema}}.is_terminal(x.status) ORDER BY x.id FOR UPDATE;
    IF EXISTS (SELECT 1 FROM {{schema}}.instances x
               WHERE x.parent_id = p_instance AND x.status IN ('PENDING', 'RUNNING', 'WAITING')
                 AND {{schema}}.child_standing(x) = 'awaited') THEN
        RETURN QUERY SELECT 'child_live', v_inst.status, NULL::integer;
        RETURN;
    END IF;
    SELECT COALESCE(max(h.visit), 0) + 1 INTO v_visit FROM {{schema}}.history h
    WHERE h.instance_id = p_instance AND COALESCE(h.position, '') = '';
    v_visit := GREATEST(v_visit, (SELECT p.visit + 1 FROM {{schema}}.positions p
                                  WHERE p.instance_id = p_instance AND p.path = ''));
    UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = v_now
    WHERE p.instance_id = p_instance AND p.path <> '' AND p.status NOT IN ('COMPLETED', 'CANCELLED');
    UPDATE {{schema}}.positions p SET status = 'RUNNING', step = p_step, visit = v_visit, wait = NULL,
        error = NULL, lease_token = NULL, lease_until = NULL, lease_owner = NULL, updated_at = v_now
    WHERE p.instance_id = p_instance AND p.path = '';
    -- Commands (ascending id): what the old path still had open is superseded.
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'REPLAYED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'DEAD')
                     AND NOT (x.kind = 'SIGNAL' AND x.state <> 'CLAIMED')
                   ORDER BY x.id FOR UPDATE);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at, created_at,
                                     actor)
    VALUES (p_instance, '', nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', p_step, v_visit, v_now, v_now,
            p_actor);
    -- A child its saga asked to compensate that has not ended (it stopped at COMPENSATION_FAILED) answers
    -- that saga no more: its link (`saga.record`) is settled, and marked, so that a retry of the child,
    -- which would undo it under a parent that goes on, is refused (retry_saga). A later round of this
    -- saga that reaches the child asks it again (compensate_child). Child rows after the parent's
    -- positions and commands, in ascending id order: the lock order.
    UPDATE {{schema}}.instances c SET saga = (c.saga - 'record') || jsonb_build_object('parent_replayed', v_now),
        updated_at = v_now
    WHERE c.id IN (SELECT x.id FROM {{schema}}.instances x
                   WHERE x.parent_id = p_instance AND x.ended_at IS NULL AND x.saga ? 'record'
                   ORDER BY x.id FOR UPDATE);
    -- The instance goes forward again: a saga it ran is over (its compensations stay recorded, and one
    -- given up is owed by the next round, saga_owe_given_up). Cleared on its own first, since while
    -- `saga` is set only the saga may change the status (instance_status_changed).
    UPDATE {{schema}}.instances i SET saga = NULL WHERE i.id = p_instance AND i.saga IS NOT NULL;
    UPDATE {{schema}}.instances i SET status = 'RUNNING', state = p_state, state_version = i.state_version + 1,
        step = p_step, visit = v_visit, wait = NULL, error = NULL, branches = 0, ended_at = NULL,
        archived_at = NULL, history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data, position)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_REPLAYED', p_step, v_visit, p_actor,
            jsonb_build_object('from_step', p_step, 'from_seq', p_from_seq, 'previous_status', v_inst.status,
                               'state', p_baseline), '');
    RETURN QUERY SELECT 'replayed', 'RUNNING'::text, v_visit;
END $$;
