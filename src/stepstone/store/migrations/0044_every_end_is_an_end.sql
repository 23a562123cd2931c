-- Every end is an end: an instance that ended COMPENSATED or TIMED_OUT is treated as one that ended
-- COMPLETED or CANCELLED by the two functions that knew only those two.
-- - migrate_instance (migration 0032) moved a timed-out instance to the target version, an
--   INSTANCE_MIGRATED entry after its end (tests/registry/test_migration.py, "an instance that timed
--   out"); COMPENSATING and COMPENSATION_FAILED instances may still move: a fixed compensation shipped as
--   a new version reaches them that way.
-- - signal_position (migration 0008) recorded a signal for it, which the worker then rejected
--   (INSTANCE_ENDED), where a signal to an ended instance is refused at once (InvalidState), as
--   docs/messages.md says (tests/sagas/test_deadlines.py).
-- Expand only: a new function, is_terminal; both functions are replaced with the same signatures.
-- The ends an instance cannot leave, in one place for the statements that ask (core.model.TERMINAL;
-- tests/test_schema_matches_migrations.py checks the two agree).
CREATE FUNCTION {{schema}}.is_terminal(p_status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_status IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT') $$;

CREATE OR REPLACE FUNCTION {{schema}}.migrate_instance(
    p_instance uuid, p_from_version integer, p_from_hash text, p_state_version bigint,
    p_to_version integer, p_to_hash text, p_step_map jsonb, p_positions jsonb, p_state jsonb, p_actor text)
RETURNS TABLE (outcome text, command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_id bigint;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.version = p_to_version AND v_inst.plan_hash = p_to_hash THEN
        RETURN QUERY SELECT 'already', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.version <> p_from_version OR v_inst.plan_hash <> p_from_hash
       OR v_inst.state_version <> p_state_version THEN
        RETURN QUERY SELECT 'changed', NULL::bigint;
        RETURN;
    END IF;
    IF {{schema}}.is_terminal(v_inst.status) THEN
        RETURN QUERY SELECT 'ended', NULL::bigint;
        RETURN;
    END IF;
    PERFORM 1 FROM {{schema}}.positions p WHERE p.instance_id = p_instance ORDER BY p.path FOR UPDATE;
    IF (SELECT count(*) FROM {{schema}}.positions p WHERE p.instance_id = p_instance)
           <> jsonb_array_length(p_positions)
       OR EXISTS (SELECT 1 FROM jsonb_array_elements(p_positions) e
                  LEFT JOIN {{schema}}.positions p ON p.instance_id = p_instance AND p.path = e->>'path'
                  WHERE p.path IS NULL OR p.step IS DISTINCT FROM e->>'step' OR p.visit <> (e->>'visit')::integer
                     OR p.status <> e->>'status') THEN
        RETURN QUERY SELECT 'changed', NULL::bigint;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM {{schema}}.positions p
               WHERE p.instance_id = p_instance AND p.lease_until IS NOT NULL AND p.lease_until > v_now)
       OR EXISTS (SELECT 1 FROM {{schema}}.commands c
                  WHERE c.instance_id = p_instance AND c.state = 'CLAIMED' AND c.available_at > v_now) THEN
        RETURN QUERY SELECT 'busy', NULL::bigint;
        RETURN;
    END IF;
    UPDATE {{schema}}.positions p SET
        step = e->>'to_step',
        wait = CASE WHEN e->'to_wait' = 'null'::jsonb THEN p.wait
                    -- a fork's: its own progress (a branch may have reported since the read), the new join
                    WHEN p.wait->>'kind' = 'join' AND e->'to_wait'->>'kind' = 'join'
                        THEN p.wait || jsonb_build_object('join', e->'to_wait'->'join')
                    ELSE e->'to_wait' END,
        updated_at = v_now
    FROM jsonb_array_elements(p_positions) e
    WHERE p.instance_id = p_instance AND p.path = e->>'path' AND e ? 'to_step';
    UPDATE {{schema}}.commands c SET step = p_step_map->>c.step
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                     AND x.step IS NOT NULL AND p_step_map ? x.step
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET
        version = p_to_version, plan_hash = p_to_hash, state = p_state,
        state_version = i.state_version + 1,
        step = COALESCE((SELECT p.step FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
                        i.step),
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, payload, available_at, created_at,
                                     settled_at)
    VALUES (p_instance, '', nextval('{{schema}}.command_seq'), 'MIGRATION', 'COMPLETE',
            jsonb_build_object('from_version', p_from_version, 'to_version', p_to_version,
                               'to_plan_hash', p_to_hash, 'step_map', p_step_map),
            v_now, v_now, v_now)
    RETURNING id INTO v_id;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_MIGRATED',
            (SELECT p.step FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
            v_inst.visit, v_id, p_actor,
            jsonb_build_object('from_version', p_from_version, 'from_plan_hash', p_from_hash,
                               'to_version', p_to_version, 'to_plan_hash', p_to_hash,
                               'step_map', p_step_map, 'positions', p_positions, 'state', p_state));
    RETURN QUERY SELECT 'migrated', v_id;
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
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope IN (v_inst.scope, v_inst.definition_scope)
                     AND d.definition_id = v_inst.definition_id
                     AND d.version = v_inst.version AND d.plan->'signals' ? p_name) THEN
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
