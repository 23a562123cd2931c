-- Compensations given up are owed again by every later round of a saga (docs/sagas.md, "When a
-- compensation keeps failing").
--
-- A compensation that gave up leaves its record FAILED. `stepstone retry` and a parent that compensates
-- such a child set it PENDING again (two copies of one statement); a new round begun by saga_begin did
-- not: a COMPENSATION_FAILED saga replayed from its failed step that failed again passed over the step
-- whose compensation was given up and ended COMPENSATED with that step never undone and no alert. The
-- statement is now one function, saga_owe_given_up, which the three call.
-- Expand only: a function added, three replaced with the same signatures (and, below, advance_saga
-- replaced, fire_schedule given a ten-argument form, start_children, replay_instance and saga_next
-- replaced).

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

-- A schedule's tick gives the instance it starts the workflow's deadlines, as a start does
-- (docs/schedules.md, docs/sagas.md "Deadlines"). fire_schedule started instances that never timed
-- out: neither the workflow's default instance deadline nor its action start step's deadline was
-- scheduled, which client starts and start_or_signal do (schedule_start_deadlines). The firing worker
-- passes both (it has the workflow); a worker of before calls the eight-argument form, which is now
-- the same function without deadlines.
CREATE FUNCTION {{schema}}.fire_schedule(
    p_name text, p_expected timestamptz, p_next timestamptz, p_ticks jsonb,
    p_version integer, p_plan_hash text, p_step text, p_state jsonb,
    p_deadline_seconds float8, p_start_deadline_seconds float8)
RETURNS TABLE (outcome text, instance_id uuid, tick timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_s {{schema}}.schedules%ROWTYPE;
    v_last uuid;
    v_status text;
    v_fired integer := 0;
    v_skipped integer := 0;
    v_id uuid;
    v_tick timestamptz;
    t record;
BEGIN
    SELECT * INTO v_s FROM {{schema}}.schedules s WHERE s.name = p_name FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'busy'::text, NULL::uuid, NULL::timestamptz;
        RETURN;
    END IF;
    IF v_s.paused OR v_s.next_fire_at <> p_expected THEN
        RETURN QUERY SELECT 'moved'::text, NULL::uuid, NULL::timestamptz;
        RETURN;
    END IF;
    v_last := v_s.last_instance;
    v_tick := v_s.last_tick;
    FOR t IN SELECT x.tick, x.id FROM jsonb_to_recordset(p_ticks) AS x(tick timestamptz, id uuid) ORDER BY x.tick LOOP
        IF v_last IS NOT NULL AND v_s.spec->>'overlap' <> 'allow' THEN
            SELECT i.status INTO v_status FROM {{schema}}.instances i WHERE i.id = v_last;
            IF v_status IS NOT NULL AND NOT {{schema}}.is_ended(v_status) THEN
                IF v_s.spec->>'overlap' = 'skip' THEN
                    v_skipped := v_skipped + 1;
                    v_tick := t.tick;
                    RETURN QUERY SELECT 'skipped'::text, v_last, t.tick;
                    CONTINUE;
                END IF;
                PERFORM {{schema}}.cancel_instance(v_last, 'schedule ' || p_name || ': overlapped by its next tick',
                                                  'schedule:' || p_name);
            END IF;
        END IF;
        v_id := {{schema}}.start_instance(t.id, v_s.scope, v_s.definition_id, p_version, p_plan_hash, p_state, p_step,
                                          NULL, 'schedule:' || p_name || ':' || (extract(epoch FROM t.tick) * 1000000)::bigint::text, 'schedule', NULL,
                                          'schedule:' || p_name);
        v_tick := t.tick;
        IF v_id IS NULL THEN
            RETURN QUERY SELECT 'duplicate'::text, t.id, t.tick;
        ELSE
            PERFORM {{schema}}.schedule_start_deadlines(v_id, NULL, p_deadline_seconds, p_step,
                                                        p_start_deadline_seconds);
            v_fired := v_fired + 1;
            v_last := v_id;
            RETURN QUERY SELECT 'started'::text, v_id, t.tick;
        END IF;
    END LOOP;
    UPDATE {{schema}}.schedules s SET next_fire_at = p_next, last_tick = v_tick, last_instance = v_last,
        fired = s.fired + v_fired, skipped = s.skipped + v_skipped, updated_at = {{schema}}.db_now()
    WHERE s.name = p_name;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.fire_schedule(
    p_name text, p_expected timestamptz, p_next timestamptz, p_ticks jsonb,
    p_version integer, p_plan_hash text, p_step text, p_state jsonb)
RETURNS TABLE (outcome text, instance_id uuid, tick timestamptz)
LANGUAGE sql AS $$
    SELECT * FROM {{schema}}.fire_schedule(p_name, p_expected, p_next, p_ticks, p_version, p_plan_hash, p_step,
                                           p_state, NULL::float8, NULL::float8);
$$;

-- A child gets its workflow's deadlines as a start does (docs/sagas.md, "Deadlines"). start_children
-- started a child step's child without its workflow's default instance deadline and without its action
-- start step's deadline, so such a child never timed out. The parent's worker, which selects the child's
-- version, now names both in each child of the commit ('deadline_seconds', 'start_deadline_seconds'), and
-- start_children schedules them for a child it inserts (schedule_start_deadlines). A child of a worker
-- of before carries neither: nothing is scheduled, as before.
CREATE OR REPLACE FUNCTION {{schema}}.start_children(p_instance uuid, p_position text, p_visit integer,
                                                     p_children jsonb, p_now timestamptz, p_actor text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_scope text;
    v_child {{schema}}.instances%ROWTYPE;
    v_status text;
    v_state jsonb;
    v_paths jsonb;
    v_path jsonb;
    v_payload jsonb;
    c jsonb;
BEGIN
    SELECT i.scope INTO v_scope FROM {{schema}}.instances i WHERE i.id = p_instance;
    FOR c IN SELECT jsonb_array_elements(p_children) ORDER BY 1 LOOP
        INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step, visit,
                                          parent_id, parent_position, parent_visit, cancel_with_parent,
                                          next_seq, history_seq, created_at, updated_at)
        VALUES ((c->>'id')::uuid, v_scope, c->>'definition_id', (c->>'version')::integer, c->>'plan_hash',
                'PENDING', c->'state', c->>'step', 1, p_instance, p_position, p_visit,
                (c->>'cancel_with_parent')::boolean, 2, 1, p_now, p_now)
        ON CONFLICT (id) DO NOTHING;
        IF FOUND THEN
            INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
            VALUES ((c->>'id')::uuid, '', 'RUNNING', c->>'step', 1, p_now, p_now);
            INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                             created_at)
            VALUES ((c->>'id')::uuid, '', 1, 'START', 'PENDING', c->>'step', 1, p_now, p_now);
            INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
            VALUES ((c->>'id')::uuid, 1, p_now, 'INSTANCE_STARTED', c->>'step', 1, p_actor,
                    jsonb_build_object('state', c->'state', 'parent', p_instance, 'parent_position', p_position));
            PERFORM {{schema}}.schedule_start_deadlines((c->>'id')::uuid, NULL, (c->>'deadline_seconds')::float8,
                                                        c->>'step', (c->>'start_deadline_seconds')::float8);
            CONTINUE;
        END IF;
        -- No lock on the child: it never waits on its parent, and a child ending meanwhile has queued its
        -- report in the same transaction that ended it, which the check below then sees.
        SELECT * INTO v_child FROM {{schema}}.instances i WHERE i.id = (c->>'id')::uuid AND i.parent_id = p_instance;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        v_status := CASE WHEN {{schema}}.is_ended(v_child.status) THEN v_child.status
                         WHEN v_child.status = 'COMPENSATING' AND v_child.saga->>'cause' = 'failed'
                              AND NOT v_child.saga ? 'record' THEN 'FAILED' END;
        IF v_status IS NULL OR EXISTS (
            SELECT 1 FROM {{schema}}.commands x
            WHERE x.instance_id = p_instance AND x.position = p_position AND x.kind = 'CHILD_COMPLETION'
              AND x.state IN ('PENDING', 'DEFERRED', 'PARKED') AND x.payload->>'child_id' = v_child.id::text) THEN
            CONTINUE;
        END IF;
        IF v_status = 'COMPLETED' THEN
            v_state := v_child.state;
            SELECT d.plan -> 'sensitive' INTO v_paths FROM {{schema}}.definitions d
            WHERE d.scope = COALESCE(v_child.definition_scope, v_child.scope)
              AND d.definition_id = v_child.definition_id AND d.version = v_child.version;
            IF jsonb_typeof(v_paths) = 'array' THEN
                FOR v_path IN SELECT jsonb_array_elements(v_paths) LOOP
                    v_state := {{schema}}.redact_path(v_state, ARRAY(SELECT jsonb_array_elements_text(v_path)));
                END LOOP;
            END IF;
            v_payload := jsonb_build_object('child_id', v_child.id, 'status', v_status, 'state', v_state);
        ELSE
            v_payload := jsonb_build_object('child_id', v_child.id, 'status', v_status, 'error', jsonb_strip_nulls(
                jsonb_build_object(
                    'step', v_child.error->>'step',
                    'type', COALESCE(v_child.error->>'type', initcap(v_status)),
                    'message', 'already ' || v_child.status || ' when the step ran again'
                               || CASE WHEN v_child.status IN ('FAILED', 'COMPENSATION_FAILED')
                                       THEN ' (retry the child first, then this instance)' ELSE '' END
                               || COALESCE(': ' || COALESCE(v_child.error->>'message', v_child.saga->>'reason'), ''))));
        END IF;
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                         created_at)
        VALUES (p_instance, p_position, nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION', 'PENDING', p_visit,
                v_payload, p_now, p_now);
    END LOOP;
END $$;

-- A replay of a saga that had ended (COMPENSATED, TIMED_OUT, or CANCELLED after compensating) or
-- stopped (COMPENSATION_FAILED) runs the instance again. replay_instance answered "replayed" and wrote
-- INSTANCE_REPLAYED, but left the instance's `saga` set, and while it is set only the saga may change
-- the status: an ended saga stayed as it was and the step to run again was rejected (INSTANCE_ENDED);
-- a stopped one read COMPENSATION_FAILED while it ran. replay_instance now ends the saga first.
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

-- The history entry that ends a saga (INSTANCE_COMPENSATED, _CANCELLED, _TIMED_OUT) lists what this
-- round compensated. It listed every compensation the instance ever made: a saga replayed after it had
-- compensated, that compensated again, named the steps of the first round too. A round begins at
-- saga->'at' (saga_begin); a round resumed by a retry keeps it.
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
                                           WHERE k.instance_id = p_instance AND k.status = 'COMPENSATED'
                                             AND k.compensated_at >= COALESCE((v_inst.saga->>'at')::timestamptz,
                                                                              '-infinity'))),
        p_now);
    -- A child that timed out or was cancelled tells its parent (a failure told it when the step failed),
    -- and so does a child its parent's saga waits on.
    IF v_inst.saga->>'cause' <> 'failed' OR v_inst.saga ? 'record' THEN
        PERFORM {{schema}}.tell_parent(v_inst, v_final, coalesce(v_inst.saga->>'reason', v_final), p_now);
    END IF;
    RETURN v_final;
END $$;
