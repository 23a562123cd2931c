-- A child step an operator's retry runs again at the visit that started its child goes on with that child
-- when the version it runs has been deprecated since (docs/versions.md).
--
-- The retried step names the child its visit started, on the version that child runs (not a selection),
-- and start_children did not start it twice: its INSERT ... ON CONFLICT (id) DO NOTHING found the row. But
-- the pin admission is a BEFORE INSERT trigger on instances, which fires before ON CONFLICT finds the row:
-- with that version deprecated since, it refused the commit (VersionNotAdmitted, nothing written), the
-- worker ran the step again and was refused again, 50 times, then crashed the segment ("the shared state
-- kept changing under the step"), and the parent never went on. Now start_children inserts a child only
-- when no instance has its id yet (ON CONFLICT stays for a race); a child that exists goes the way it went
-- before: the step's report of it, when it has ended. One primary-key probe per child a commit starts.
-- Expand only: start_children replaced with the same signature.

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
    v_started boolean;
    c jsonb;
BEGIN
    SELECT i.scope INTO v_scope FROM {{schema}}.instances i WHERE i.id = p_instance;
    FOR c IN SELECT jsonb_array_elements(p_children) ORDER BY 1 LOOP
        -- A child that exists already (the step runs again at the visit that started it: an operator's
        -- retry) is not inserted again: the pin admission (a BEFORE INSERT trigger) fires before ON
        -- CONFLICT finds the row, and refused the version that child runs once it was deprecated.
        v_started := false;
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.instances i WHERE i.id = (c->>'id')::uuid) THEN
            INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step,
                                              visit, parent_id, parent_position, parent_visit, cancel_with_parent,
                                              next_seq, history_seq, created_at, updated_at)
            VALUES ((c->>'id')::uuid, v_scope, c->>'definition_id', (c->>'version')::integer, c->>'plan_hash',
                    'PENDING', c->'state', c->>'step', 1, p_instance, p_position, p_visit,
                    (c->>'cancel_with_parent')::boolean, 2, 1, p_now, p_now)
            ON CONFLICT (id) DO NOTHING;
            v_started := FOUND;
        END IF;
        IF v_started THEN
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

