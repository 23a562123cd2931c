-- A parent replayed forward settles its saga's link to a child that could not compensate
-- (docs/sagas.md, "When a compensation keeps failing"; docs/operations.md, "Replay").
--
-- A child the parent's saga asked to compensate (compensate_child: `saga.record`, the parent's
-- compensation it answers) that stopped at COMPENSATION_FAILED stops its parent too. When an operator
-- then replayed the parent (`stepstone replay`), the parent went forward and could complete, but the
-- child kept its link: a later `stepstone retry` of the child resumed its compensation and undid the
-- child under a parent that had gone on with it (the child ended COMPENSATED under a COMPLETED parent,
-- whose saga ignored its report). Now the replay settles the link of each such child (one not ended
-- whose saga answers this parent's): `record` is removed and the child marked `parent_replayed`, and
-- retry_saga refuses to retry a COMPENSATION_FAILED instance so marked (outcome parent_went_on; the
-- client raises InvalidState naming the parent). Replaying the child takes it forward too; cancelling it
-- leaves it as it is. Should a later round of the parent's saga reach the child (the compensation given
-- up is owed again), compensate_child links it again and clears the mark.
-- Expand only: compensate_child, retry_saga and replay_instance replaced with the same signatures.

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
        UPDATE {{schema}}.instances i SET saga = (i.saga - 'parent_replayed') || jsonb_build_object('record', p_record)
        WHERE i.id = p_child;
    ELSIF v_child.status = 'COMPENSATION_FAILED' THEN
        -- (A link a replay of this parent settled, replay_instance, is made again: this round asks.)
        UPDATE {{schema}}.instances i SET saga = (i.saga - 'parent_replayed') || jsonb_build_object('record', p_record),
            error = NULL
        WHERE i.id = p_child;
        UPDATE {{schema}}.positions p SET status = 'SAGA' WHERE p.instance_id = p_child AND p.path = '$saga';
        PERFORM {{schema}}.saga_owe_given_up(p_child);
        PERFORM {{schema}}.saga_next(p_child, p_now, p_actor);
    ELSE
        v_child.saga := jsonb_build_object('cause', 'parent', 'record', p_record);
        PERFORM {{schema}}.tell_parent(v_child, COALESCE(v_child.status, 'MISSING'), 'the child had ended', p_now);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.retry_saga(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF FOUND AND v_inst.status = 'COMPENSATION_FAILED' AND v_inst.saga ? 'parent_replayed' THEN
        RETURN QUERY SELECT 'parent_went_on', v_inst.status;
        RETURN;
    END IF;
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

