-- Commit path, round 2 (performance): the same writes with fewer statements per start and fewer clock
-- reads per claim.
--
-- start_instance: the dedup row, instance, root position, START command and history row in one
-- statement instead of five. db_now: plpgsql, so its plan is kept for the session (the claim reads it
-- once per statement now, see queries.sql). docs/performance.md ("Commit path, round 2") has the
-- measurements that chose these shapes.

-- Start an instance: idempotency key, instance row, root position, START command and the baseline
-- history entry, in one statement (one executor run instead of five). Returns the new id, or NULL when
-- the key was already used (the caller then reads the dedup row). The instance rows are written only
-- when there is no key or the key's row was inserted here.
CREATE OR REPLACE FUNCTION {{schema}}.start_instance(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text,
    p_state jsonb, p_step text, p_business_key text, p_key text, p_fingerprint text,
    p_parent uuid, p_actor text)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
BEGIN
    WITH clock AS (
        SELECT {{schema}}.db_now() AS now
    ), key AS (
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        SELECT 'START', p_scope || '/' || p_definition, p_key, p_fingerprint, p_id::text, clock.now FROM clock
        WHERE p_key IS NOT NULL
        ON CONFLICT DO NOTHING
        RETURNING 1
    ), go AS (
        SELECT clock.now FROM clock WHERE p_key IS NULL OR EXISTS (SELECT 1 FROM key)
    ), inst AS (
        INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step,
                                          visit, business_key, parent_id, next_seq, history_seq,
                                          created_at, updated_at)
        SELECT p_id, p_scope, p_definition, p_version, p_plan_hash, 'PENDING', p_state, p_step,
               1, p_business_key, p_parent, 2, 1, go.now, go.now FROM go
        RETURNING id
    ), pos AS (
        INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
        SELECT p_id, '', 'RUNNING', p_step, 1, go.now, go.now FROM go
    ), cmd AS (
        INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, dedup_key, available_at,
                                         created_at)
        SELECT p_id, 1, 'START', 'PENDING', p_step, 1, p_key, go.now, go.now FROM go
    ), hist AS (
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
        SELECT p_id, 1, go.now, 'INSTANCE_STARTED', p_step, 1, p_actor,
               jsonb_build_object('state', p_state, 'version', p_version, 'plan_hash', p_plan_hash) FROM go
    )
    SELECT inst.id FROM inst
    INTO v_id;
    RETURN v_id;
END $$;

-- The one clock, in plpgsql: the same expression as before, but its plan is kept for the session. As a
-- SQL-language function (not inlinable: it reads a table) it was parsed and planned again in every
-- statement that calls it, once per call site (a claim had nine): 10% of the server's CPU in the
-- throughput workload (perf: fmgr_sql -> raw_parser, pg_plan_query).
CREATE OR REPLACE FUNCTION {{schema}}.db_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$ BEGIN RETURN now() + (SELECT offset_by FROM {{schema}}.clock); END $$;
