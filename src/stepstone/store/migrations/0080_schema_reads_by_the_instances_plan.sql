-- The schema functions read the plan an instance runs: its definition scope's row, and its own plan hash.
--
-- retry_instance queued each retried step's deadline timer from the registry row of (instance scope, id,
-- version). An instance of a scope with no registration of its own runs the default scope's registration
-- (definition_scope 'default', set by the pin admission; migration 0008): no row matched its own scope, so
-- an operator's retry queued no deadline timer and the retried step ran unbounded
-- (tests/sagas/test_failed_deadline.py). It reads the definition scope's row now.
--
-- An id the registry has never seen is admitted (an engine used without registration), so an instance can
-- run a plan that is not stored while its version is registered later with other code (another plan hash,
-- no drift). The functions below read that other code's row as the instance's plan
-- (tests/registry/test_schema_reads_by_plan_hash.py):
-- - signal_position (every signal the client sends) and send_signal accepted a signal only the other code
--   declares. They accept a signal the instance's own plan declares (the row of its plan hash); a plan that
--   is not stored declares nothing known, which is how an instance no registration knows was answered
--   already (unknown_signal): the other code's row is no longer trusted, nothing else is refused.
-- - retry_instance bounded a retried step by the other code's deadline for a step of that name. It reads the
--   deadlines of the own plan only: none when it is not stored (as for an instance no registration knows).
--   The own plan is looked for in the definition scope, then in the instance's own scope: an instance started
--   before any registration keeps definition_scope 'default' when its code is registered in its own scope
--   later (the fix above, reading the definition scope alone, queued no timer for it, where reading the
--   instance's scope had found one).
-- - start_children redacted the report of an existing child (a step run again by an operator's retry) by the
--   other code's sensitive paths. It redacts by pinned_sensitive_paths: the own plan's paths when stored,
--   otherwise every path a stored plan of the workflow marks (as the views do since 99ac48c), never less than
--   the version's row.
-- redact_baseline and start_batch are unchanged: an INSTANCE_STARTED or INSTANCE_MIGRATED entry is written in
-- the transaction that admitted the instance's pin (admit_pin, or start_batch's own admitted_scope), under
-- the definition id's shared lock, and the admission refuses a pin whose version is stored with another plan
-- (SSR02): the version's row they read is the own plan's, or no plan of the id is stored at all.
-- Expand only: send_signal, signal_position, retry_instance and start_children replaced with the same
-- signatures; pinned_sensitive_paths and stored_sensitive_paths are new.

-- Every path any stored plan of a workflow marks under `p_key` ('sensitive' or 'sensitive_payloads'), in the
-- two scopes given: what an instance whose own plan is not stored is redacted by, since its own paths are
-- unknown (never less than the version's row). The one place of that rule: pinned_sensitive_paths and the
-- operators' reads (management.sql's instance_redactions, operations.sql's instance_extra) use it.
CREATE FUNCTION {{schema}}.stored_sensitive_paths(p_scope text, p_definition_scope text, p_definition_id text,
                                                  p_key text)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_agg(DISTINCT p) FROM {{schema}}.definitions d
    CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(d.plan -> p_key) = 'array'
                                                 THEN d.plan -> p_key END) p
    WHERE d.scope IN (p_definition_scope, p_scope) AND d.definition_id = p_definition_id
$$;

CREATE FUNCTION {{schema}}.pinned_sensitive_paths(p_scope text, p_definition_scope text, p_definition_id text,
                                                  p_version integer, p_plan_hash text)
RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_plan jsonb;
BEGIN
    SELECT o.plan INTO v_plan FROM {{schema}}.definitions o
    WHERE o.scope IN (p_definition_scope, p_scope) AND o.definition_id = p_definition_id
      AND o.version = p_version AND o.plan_hash = p_plan_hash
    ORDER BY o.scope = p_definition_scope DESC LIMIT 1;
    IF FOUND THEN
        RETURN v_plan -> 'sensitive';
    END IF;
    RETURN {{schema}}.stored_sensitive_paths(p_scope, p_definition_scope, p_definition_id, 'sensitive');
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.send_signal(
    p_instance uuid, p_name text, p_payload jsonb, p_dedup_key text, p_fingerprint text, p_actor text)
RETURNS TABLE (outcome text, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_seq bigint;
    v_id bigint;
    v_prior record;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint, NULL::text;
        RETURN;
    END IF;
    -- The plan the instance runs (its plan hash): another plan stored for its version is not its plan, and a
    -- plan that is not stored declares nothing known, as for an instance no registration knows.
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope IN (v_inst.scope, v_inst.definition_scope)
                     AND d.definition_id = v_inst.definition_id AND d.version = v_inst.version
                     AND d.plan_hash = v_inst.plan_hash AND d.plan->'signals' ? p_name) THEN
        RETURN QUERY SELECT 'unknown_signal', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    IF p_dedup_key IS NOT NULL THEN
        SELECT x.fingerprint, x.target INTO v_prior FROM {{schema}}.dedup x
        WHERE x.kind = 'SIGNAL' AND x.namespace = p_instance::text AND x.key = p_dedup_key;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN v_prior.fingerprint = p_fingerprint THEN 'duplicate' ELSE 'conflict' END,
                                v_prior.target::bigint, v_inst.status;
            RETURN;
        END IF;
    END IF;
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
        RETURN QUERY SELECT 'ended', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    UPDATE {{schema}}.instances i SET next_seq = i.next_seq + 1 WHERE i.id = p_instance
    RETURNING i.next_seq - 1 INTO v_seq;
    INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, name, payload, dedup_key, available_at, created_at)
    VALUES (p_instance, v_seq, 'SIGNAL', 'PENDING', p_name, p_payload, p_dedup_key, v_now, v_now)
    RETURNING id INTO v_id;
    IF p_dedup_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('SIGNAL', p_instance::text, p_dedup_key, p_fingerprint, v_id::text, v_now);
    END IF;
    RETURN QUERY SELECT 'recorded', v_id, v_inst.status;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.signal_position(
    p_instance uuid, p_position text, p_name text, p_payload jsonb, p_dedup_key text, p_fingerprint text,
    p_actor text)
RETURNS TABLE (outcome text, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_id bigint;
    v_prior record;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint, NULL::text;
        RETURN;
    END IF;
    -- The plan the instance runs (its plan hash): another plan stored for its version is not its plan, and a
    -- plan that is not stored declares nothing known, as for an instance no registration knows.
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope IN (v_inst.scope, v_inst.definition_scope)
                     AND d.definition_id = v_inst.definition_id AND d.version = v_inst.version
                     AND d.plan_hash = v_inst.plan_hash AND d.plan->'signals' ? p_name) THEN
        RETURN QUERY SELECT 'unknown_signal', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    IF p_position <> '' AND NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                                        WHERE p.instance_id = p_instance AND p.path = p_position) THEN
        RETURN QUERY SELECT 'no_position', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    IF p_dedup_key IS NOT NULL THEN
        SELECT x.fingerprint, x.target INTO v_prior FROM {{schema}}.dedup x
        WHERE x.kind = 'SIGNAL' AND x.namespace = p_instance::text AND x.key = p_dedup_key;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN v_prior.fingerprint = p_fingerprint THEN 'duplicate' ELSE 'conflict' END,
                                v_prior.target::bigint, v_inst.status;
            RETURN;
        END IF;
    END IF;
    IF {{schema}}.is_terminal(v_inst.status) THEN
        RETURN QUERY SELECT 'ended', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, name, payload, dedup_key,
                                     available_at, created_at)
    VALUES (p_instance, p_position, nextval('{{schema}}.command_seq'), 'SIGNAL', 'PENDING', p_name, p_payload,
            p_dedup_key, v_now, v_now)
    RETURNING id INTO v_id;
    IF p_dedup_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('SIGNAL', p_instance::text, p_dedup_key, p_fingerprint, v_id::text, v_now);
    END IF;
    RETURN QUERY SELECT 'recorded', v_id, v_inst.status;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_retries bigint[];
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
               'step_deadline', jsonb_build_object('position', r.position, 'step', r.step, 'visit', r.visit),
               v_now + make_interval(secs => (s->'deadline'->>'seconds')::float8), v_now
        FROM {{schema}}.commands r
        CROSS JOIN LATERAL jsonb_array_elements(v_plan->'steps') AS s
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
            -- The child's own plan's paths; when it is not stored, every path a stored plan of its workflow
            -- marks (pinned_sensitive_paths, version 80).
            v_paths := {{schema}}.pinned_sensitive_paths(v_child.scope, COALESCE(v_child.definition_scope,
                                                                                  v_child.scope),
                                                         v_child.definition_id, v_child.version, v_child.plan_hash);
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
