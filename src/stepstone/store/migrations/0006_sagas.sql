-- Sagas: compensation, deadlines, and cancellation that settles everything (core/saga.py).
--
-- A step that declares a compensation leaves a row in `compensations` when it completes (section
-- 'compensable', rank 10): what it recorded, in the order of completion (the id: commits of one
-- instance serialize on its row). A saga runs on a position of its own, '$saga', beside the root and
-- the branches: its deadline timer and its COMPENSATE commands queue there, so a busy root position
-- never holds them up. Section 'saga' (rank 11) begins a saga (closing every other position, taking
-- their leases so a running handler's commit is refused, settling their open commands and children),
-- queues the next compensation (the latest PENDING row), and ends the instance when none is left:
-- COMPENSATED after a failure, CANCELLED after a cancel, TIMED_OUT after the deadline. A compensation
-- given up makes the instance COMPENSATION_FAILED; retry resumes it where it stopped.
--
-- Lock order inside a saga function: the instance row (taken by its caller) -> positions (ascending
-- path) -> commands (ascending id) -> child instances (ascending id) -> compensations -> history.

ALTER TABLE {{schema}}.instances ADD COLUMN deadline_at timestamptz;
-- Why and when the saga began ({cause, reason, actor, at}); NULL while the instance never compensated.
ALTER TABLE {{schema}}.instances ADD COLUMN saga jsonb;

CREATE TABLE {{schema}}.compensations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    instance_id uuid NOT NULL,
    position text NOT NULL,
    step text NOT NULL,
    visit integer NOT NULL,
    recorded jsonb,
    -- PENDING (to undo), COMPENSATED, FAILED (given up; an operator's retry makes it PENDING again)
    status text NOT NULL DEFAULT 'PENDING',
    attempts integer NOT NULL DEFAULT 0,
    last_error jsonb,
    completed_at timestamptz NOT NULL,
    compensated_at timestamptz
);
CREATE INDEX compensations_instance ON {{schema}}.compensations (instance_id, id);

-- Once a saga has begun, only the saga decides the instance's status: a late command on a closed
-- position (a signal sent meanwhile, say) commits a status derived from positions, which must not
-- undo it. The saga's own writes go to COMPENSATING or COMPENSATION_FAILED, or end the instance
-- (setting ended_at); nothing changes the status of an instance that has ended.
CREATE FUNCTION {{schema}}.keep_saga_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.ended_at IS NULL AND (NEW.status IN ('COMPENSATING', 'COMPENSATION_FAILED')
                                 OR NEW.ended_at IS DISTINCT FROM OLD.ended_at) THEN
        RETURN NEW;
    END IF;
    NEW.status := OLD.status;
    RETURN NEW;
END $$;

CREATE TRIGGER instances_keep_saga_status
    BEFORE UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (OLD.saga IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.keep_saga_status();

-- wait_for returns on these too.
CREATE TRIGGER instances_notify_saga_settled
    AFTER UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (NEW.status IN ('COMPENSATED', 'TIMED_OUT', 'COMPENSATION_FAILED')
                       AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.notify_settled();

-- The saga's own position: its deadline timers and its compensations queue there.
CREATE FUNCTION {{schema}}.open_saga_position(p_instance uuid, p_now timestamptz)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {{schema}}.positions (instance_id, path, status, visit, created_at, updated_at)
    VALUES (p_instance, '$saga', 'SAGA', 1, p_now, p_now)
    ON CONFLICT (instance_id, path) DO NOTHING;
$$;

-- One history entry written by a saga function, after whatever the commit itself records.
CREATE FUNCTION {{schema}}.saga_history(p_instance uuid, p_kind text, p_step text, p_visit integer,
                                        p_position text, p_command bigint, p_actor text, p_data jsonb,
                                        p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
BEGIN
    UPDATE {{schema}}.instances i SET history_seq = i.history_seq + 1 WHERE i.id = p_instance
    RETURNING i.history_seq INTO v_seq;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
    VALUES (p_instance, v_seq, p_now, p_kind, p_step, p_visit, p_command, p_actor, p_data, p_position);
END $$;

-- Settle every open command of an instance (PENDING, DEFERRED, CLAIMED, PARKED, DEAD) as CANCELLED,
-- in ascending id order, with one COMMAND_CANCELLED history entry each naming who and why. Timers
-- are commands, so they are finished here too. `p_position` and `p_kinds` narrow it to one position's
-- commands of those kinds (a step deadline); `p_code` starts each command's last_error. Returns how
-- many it settled.
CREATE FUNCTION {{schema}}.settle_open_commands(p_instance uuid, p_reason text, p_actor text, p_now timestamptz,
                                                p_position text DEFAULT NULL, p_kinds text[] DEFAULT NULL,
                                                p_code text DEFAULT 'INSTANCE_CANCELLED')
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
    v_n integer;
BEGIN
    SELECT i.history_seq INTO v_seq FROM {{schema}}.instances i WHERE i.id = p_instance;
    WITH locked AS (
        SELECT x.id, x.state FROM {{schema}}.commands x
        WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
          AND (p_position IS NULL OR x.position = p_position) AND (p_kinds IS NULL OR x.kind = ANY (p_kinds))
        ORDER BY x.id FOR UPDATE
    ), settled AS (
        UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = p_now,
            last_error = p_code || ': ' || c.kind
        FROM locked WHERE c.id = locked.id
        RETURNING c.id, c.kind, c.name, c.position, c.step, c.visit, locked.state AS was
    )
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
    SELECT p_instance, v_seq + (row_number() OVER (ORDER BY s.id))::integer, p_now, 'COMMAND_CANCELLED', s.step,
           s.visit, s.id, p_actor,
           jsonb_strip_nulls(jsonb_build_object('command', s.id, 'kind', s.kind, 'name', left(s.name, 128),
                                                'was', s.was, 'reason', p_reason)),
           s.position
    FROM settled s;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.instances i SET history_seq = i.history_seq + v_n WHERE i.id = p_instance;
    RETURN v_n;
END $$;

-- Close an instance's positions and take their leases, so a handler still running there commits
-- nothing; `p_keep` (the position whose commit this is) keeps its lease. For a saga (`p_saga`), a
-- FAILED position stays FAILED (it shows where it failed) and '$saga' stays open.
CREATE FUNCTION {{schema}}.close_positions(p_instance uuid, p_now timestamptz, p_keep text, p_saga boolean)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {{schema}}.positions p SET
        status = CASE WHEN p.status IN ('COMPLETED', 'CANCELLED') THEN p.status
                      WHEN p_saga AND (p.path = '$saga' OR p.status = 'FAILED') THEN p.status
                      ELSE 'CANCELLED' END,
        lease_token = CASE WHEN p.path = p_keep THEN p.lease_token END,
        lease_until = CASE WHEN p.path = p_keep THEN p.lease_until END,
        lease_owner = CASE WHEN p.path = p_keep THEN p.lease_owner END,
        updated_at = p_now
    WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                      WHERE x.instance_id = p_instance ORDER BY x.path FOR UPDATE);
END $$;

-- The children that go with their parent (cancel_with_parent), cancelled in ascending id order.
CREATE FUNCTION {{schema}}.cancel_children(p_instance uuid, p_reason text, p_actor text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_child uuid;
BEGIN
    FOR v_child IN SELECT i.id FROM {{schema}}.instances i
                   WHERE i.parent_id = p_instance AND i.cancel_with_parent
                     AND i.status NOT IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT') ORDER BY i.id LOOP
        PERFORM {{schema}}.cancel_tree(v_child, p_reason, p_actor, false);
    END LOOP;
END $$;

-- A child that ended other than by completing tells its parent's position; a child its parent's saga
-- asked to compensate tells the parent's '$saga' position which compensation it answers.
CREATE FUNCTION {{schema}}.tell_parent(p_child {{schema}}.instances, p_status text, p_message text,
                                       p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_for_saga boolean := p_child.saga->>'cause' = 'parent';
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

-- Cancel one instance and everything under it (replaces migration 0002's): its open commands, each
-- with its own history entry, its positions, and the children cancelled with their parent.
-- `p_notify` tells the parent (an operator's cancel of a child). Returns the status afterwards.
CREATE OR REPLACE FUNCTION {{schema}}.cancel_tree(p_instance uuid, p_reason text, p_actor text, p_notify boolean)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_n integer;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND OR v_inst.status IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT') THEN
        RETURN v_inst.status;
    END IF;
    PERFORM {{schema}}.close_positions(p_instance, v_now, NULL, false);
    v_n := {{schema}}.settle_open_commands(p_instance, p_reason, p_actor, v_now);
    UPDATE {{schema}}.instances i SET status = 'CANCELLED', wait = NULL, branches = 0, updated_at = v_now,
        ended_at = v_now
    WHERE i.id = p_instance;
    PERFORM {{schema}}.saga_history(p_instance, 'INSTANCE_CANCELLED', v_inst.step, v_inst.visit, NULL, NULL,
                                    p_actor, jsonb_build_object('reason', p_reason, 'commands_cancelled', v_n,
                                                                'status_before', v_inst.status), v_now);
    PERFORM {{schema}}.cancel_children(p_instance, 'parent cancelled', p_actor);
    IF p_notify THEN
        PERFORM {{schema}}.tell_parent(v_inst, 'CANCELLED', p_reason, v_now);
    END IF;
    RETURN 'CANCELLED';
END $$;

-- Queue the next compensation (the latest completed step not yet compensated) on '$saga', or, when
-- none is left, end the instance by why it compensated. Returns the instance's status afterwards.
CREATE FUNCTION {{schema}}.saga_next(p_instance uuid, p_now timestamptz, p_actor text)
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
    -- A child that timed out or was cancelled tells its parent (a failure told it when the step failed).
    IF v_inst.saga->>'cause' <> 'failed' THEN
        PERFORM {{schema}}.tell_parent(v_inst, v_final, coalesce(v_inst.saga->>'reason', v_final), p_now);
    END IF;
    RETURN v_final;
END $$;

-- Begin a saga: every position but '$saga' is closed (a failed one keeps FAILED) and loses its lease
-- (so a handler still running there commits nothing), except `p_keep`, the position whose commit this
-- is; their open commands are settled one history entry each; children are cancelled with their
-- parent; then the first compensation is queued (or the instance ends when there is none).
CREATE FUNCTION {{schema}}.saga_begin(p_instance uuid, p_cause text, p_reason text, p_actor text, p_now timestamptz,
                                      p_keep text, p_record bigint DEFAULT NULL)
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
    PERFORM {{schema}}.cancel_children(p_instance, 'parent compensating', p_actor);
    RETURN {{schema}}.saga_next(p_instance, p_now, p_actor);
END $$;

-- The parent's saga compensates a child it completed: the child compensates its own steps (its
-- saga begins, or resumes where it stopped) and reports to the parent's '$saga' position when it
-- ends, naming `p_record`. A child that has already ended another way answers at once.
CREATE FUNCTION {{schema}}.compensate_child(p_child uuid, p_record bigint, p_actor text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_child {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_child FROM {{schema}}.instances i WHERE i.id = p_child FOR UPDATE;
    IF v_child.status = 'COMPLETED' THEN
        PERFORM {{schema}}.saga_begin(p_child, 'parent', 'the parent compensates', p_actor, p_now, NULL, p_record);
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

-- Section 'compensable': remember the compensable steps this commit completed.
CREATE FUNCTION {{schema}}.record_compensable(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT (p_commit->>'instance')::uuid, p_commit->>'position', x.c->>'step', (x.c->>'visit')::integer,
           NULLIF(x.c->'recorded', 'null'::jsonb), p_now
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(c, ord)
    ORDER BY x.ord;
END $$;

-- Section 'saga': begin, one compensation done (then the next), an attempt failed, or given up.
CREATE FUNCTION {{schema}}.advance_saga(p_commit jsonb, p_items jsonb, p_now timestamptz)
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
            IF (SELECT i.saga->>'cause' FROM {{schema}}.instances i WHERE i.id = v_id) = 'parent' THEN
                PERFORM {{schema}}.tell_parent(i, 'COMPENSATION_FAILED', x->'error'->>'message', p_now)
                FROM {{schema}}.instances i WHERE i.id = v_id;
            END IF;
        ELSE
            UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = v_id;
        END IF;
    END LOOP;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('compensable', 10, 'record_compensable'), ('saga', 11, 'advance_saga');

-- cancel(compensate): compensate first, then CANCELLED. Outcomes: not_found; unchanged (already
-- ended, or already compensating when asked to compensate); cancelled; compensating.
CREATE FUNCTION {{schema}}.cancel_saga(p_instance uuid, p_reason text, p_actor text, p_compensate boolean)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_before text;
    v_after text;
BEGIN
    SELECT i.status INTO v_before FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    IF v_before IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT')
       OR (p_compensate AND v_before IN ('COMPENSATING', 'COMPENSATION_FAILED')) THEN
        RETURN QUERY SELECT 'unchanged', v_before;
        RETURN;
    END IF;
    IF NOT p_compensate THEN
        RETURN QUERY SELECT 'cancelled', {{schema}}.cancel_tree(p_instance, p_reason, p_actor, true);
        RETURN;
    END IF;
    PERFORM {{schema}}.saga_history(p_instance, 'CANCEL_REQUESTED', NULL, NULL, NULL, NULL, p_actor,
                                    jsonb_build_object('reason', p_reason, 'compensate', true,
                                                       'status_before', v_before), v_now);
    v_after := {{schema}}.saga_begin(p_instance, 'cancelled', p_reason, p_actor, v_now, NULL);
    RETURN QUERY SELECT 'compensating', v_after;
END $$;

-- Retry: a COMPENSATION_FAILED instance resumes its compensation at the one given up (from its first
-- attempt); anything else goes to retry_instance.
CREATE FUNCTION {{schema}}.retry_saga(p_instance uuid, p_actor text)
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
        UPDATE {{schema}}.compensations k SET status = 'PENDING'
        WHERE k.id IN (SELECT y.id FROM {{schema}}.compensations y
                       WHERE y.instance_id = p_instance AND y.status = 'FAILED' ORDER BY y.id FOR UPDATE);
        UPDATE {{schema}}.instances i SET error = NULL WHERE i.id = p_instance;
        PERFORM {{schema}}.saga_history(p_instance, 'INSTANCE_RETRIED', NULL, NULL, NULL, NULL, p_actor,
                                        jsonb_build_object('error', v_inst.error, 'compensation', true), v_now);
        RETURN QUERY SELECT 'retried', {{schema}}.saga_next(p_instance, v_now, p_actor);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM {{schema}}.retry_instance(p_instance, p_actor);
END $$;

-- An instance deadline: a TIMER 'deadline' on '$saga', in the start's own statement.
CREATE FUNCTION {{schema}}.schedule_deadline(p_instance uuid, p_at timestamptz, p_seconds float8)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_at timestamptz := COALESCE(p_at, v_now + make_interval(secs => p_seconds));
BEGIN
    IF p_instance IS NULL OR (p_at IS NULL AND p_seconds IS NULL) THEN
        RETURN p_instance;
    END IF;
    v_at := GREATEST(v_at, v_now);
    PERFORM {{schema}}.open_saga_position(p_instance, v_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, name, visit, available_at, created_at)
    VALUES (p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', 'deadline', 1, v_at, v_now);
    UPDATE {{schema}}.instances i SET deadline_at = v_at WHERE i.id = p_instance;
    RETURN p_instance;
END $$;

-- Step deadlines. Entering an action step that declares one queues a TIMER 'step_deadline' on '$saga'
-- (section 'step_deadlines', rank 12), so a handler running on the step's own position does not hold it
-- up. When it fires there (section 'interrupts', rank 13) and the position still runs that step visit,
-- the position loses its lease (the handler's commit is refused), its step commands are settled with
-- one history entry each, and a TIMER 'step_deadline' is queued on it, which moves it to the step's
-- on_deadline, or fails the step.
CREATE FUNCTION {{schema}}.schedule_step_deadlines(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
BEGIN
    PERFORM {{schema}}.open_saga_position(v_id, p_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     available_at, created_at)
    SELECT v_id, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', x->>'step', (x->>'visit')::integer,
           'step_deadline',
           jsonb_build_object('position', p_commit->>'position', 'step', x->>'step', 'visit', (x->>'visit')::integer),
           p_now + make_interval(secs => (x->>'seconds')::float8), p_now
    FROM jsonb_array_elements(p_items) AS x;
END $$;

CREATE FUNCTION {{schema}}.interrupt_steps(p_commit jsonb, p_items jsonb, p_now timestamptz)
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
          AND p.visit = (x->>'visit')::integer AND p.status = 'RUNNING';
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

INSERT INTO {{schema}}.effect_sections VALUES ('step_deadlines', 12, 'schedule_step_deadlines'),
                                              ('interrupts', 13, 'interrupt_steps');
