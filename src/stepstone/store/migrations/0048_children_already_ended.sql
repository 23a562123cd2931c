-- A retried parent never waits on a child that has already ended (docs/branches.md, "Child workflows").
--
-- A child step that runs again at the same visit (the instance retried after its child failed) names the
-- same child: its id is derived from (parent, position, step, visit), so start_children found it there
-- (ON CONFLICT DO NOTHING), started nothing, and the parent position waited for a report the ended child
-- had already sent (ignored while the parent was FAILED) and would never send again; `stepstone stuck`
-- saw nothing wrong. Now start_children tells the parent at once of a child that has ended: a child
-- retried to COMPLETED lets the parent go on with its final state, one still FAILED fails the step again
-- at once (ChildFailed, telling the operator to retry the child first), and a branch's child step does
-- the same for its branch. A child still running reports when it ends, as before.
-- Expand only: start_children is replaced with the same signature; commit_decision calls it as before.

-- Start the children a step asked for, in that step's commit. The id is derived from the parent
-- position's step visit, so a second insert of the same child does nothing. When the step ran again at
-- the same visit (a retried parent) and its child is already there, the child starts no second time: a
-- child that has not ended reports when it ends, as before; one that has ended, or that reported a
-- failure it now compensates, will never report again, so the parent position is told its end at once
-- (a CHILD_COMPLETION with the payload the child's own report carries: COMPLETED with its final state,
-- redacted at its definition's sensitive paths, else its status and error), unless such a report
-- already waits in the position's queue.
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
