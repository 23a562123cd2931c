-- A command deferred for want of its plan is routed to the workers that have the plan.
--
-- During a rolling deploy with workers of the old release (version 1 alone) beside workers of the new one
-- (version 2 alone), any worker of the definition claimed any of its commands, and one that lacked the
-- instance's pinned version deferred it (defer_command) with a backoff, min(0.25 s * 2^deferrals, 1 s)
-- since 0070 while a worker that has the pin heartbeats; the command stayed under its definition id in
-- commands_ready, so a worker of the wrong release could claim it again at each of its claims, one
-- deferral more each time (tests/registry/test_registry.py: a v1-only worker claimed a v2 command four
-- times in four claims a second apart, beside a live v2 worker).
--
-- Now a deferral moves the command to a route of its own: commands.definition, the key every walk of ready
-- work reads (commands_ready), becomes the pin's `definition_id@version@plan_hash` (command_route), and
-- the open commands queued behind it on its position move with it. Each worker names, among the keys it
-- serves, the routes of the pins it has (Pin.route in the worker's served list, runtime/worker.py), so only
-- a worker that has the plan walks it, and the deferral needs no backoff: claimable at once. A command
-- deferred again on its route (only a claim given no served list walks every key) backs off as before.
-- A migration of the instance re-pins it: migrate_instance moves its routed commands back to the
-- definition id. Commands of a pin no worker has stay DEFERRED with their NOT_RUNNABLE reason, counted by
-- `stepstone doctor` and the stranded report as before.
--
-- The claim's statement walks the keys it is given, as before (one probe of commands_ready per served key:
-- a worker with one version of one definition walks two keys where it walked one; docs/performance.md,
-- "Deferred commands routed by pin"). A worker of an earlier release names its definition ids alone (no
-- key holds '@'); claim_heads then adds the routes of those definitions (served_with_routes), so that
-- through a rolling upgrade of stepstone, or after a rollback, such a worker still takes routed commands
-- (and defers again those it lacks). Commands deferred before this migration stay under their id until
-- deferred again.

CREATE FUNCTION {{schema}}.command_route(p_definition text, p_version integer, p_plan_hash text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_definition || '@' || p_version::text || '@' || p_plan_hash $$;

-- A served list of definition ids alone (a worker of a release before version 76) with the routes of those
-- definitions: each recorded version's, and each one that has ready work. Such a worker claims routed
-- commands as it claimed every command of its definitions before, and defers those it lacks again.
CREATE FUNCTION {{schema}}.served_with_routes(p_served text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_served IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN p_served || ARRAY(
        SELECT {{schema}}.command_route(d.definition_id, d.version, d.plan_hash)
        FROM {{schema}}.definitions d WHERE d.definition_id = ANY (p_served)
        UNION
        SELECT k FROM unnest({{schema}}.ready_definitions()) AS r(k)
        WHERE strpos(k, '@') > 0 AND split_part(k, '@', 1) = ANY (p_served));
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.defer_command(p_instance uuid, p_path text, p_token uuid, p_reason text)
RETURNS TABLE (command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_cmd {{schema}}.commands%ROWTYPE;
    v_route text;
    v_backoff double precision := 0;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
    WHERE p.instance_id = p_instance AND p.path = p_path AND p.lease_token = p_token;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO v_cmd FROM {{schema}}.commands c
    WHERE c.instance_id = p_instance AND c.position = p_path AND c.token = p_token AND c.state = 'CLAIMED'
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_route := {{schema}}.command_route(v_inst.definition_id, v_inst.version, v_inst.plan_hash);
    IF v_cmd.definition = v_route THEN  -- already routed: taken by a claim that walks every key
        IF EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
                   WHERE w.definition_id = v_inst.definition_id AND w.version = v_inst.version
                     AND w.plan_hash = v_inst.plan_hash AND w.seen_at > v_now - interval '30 seconds') THEN
            v_backoff := LEAST(1, 0.25 * power(2, v_cmd.deferrals));  -- a worker that has it is up
        ELSE
            v_backoff := LEAST(300, 5 * power(2, v_cmd.deferrals));
        END IF;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'DEFERRED', token = NULL, claims = GREATEST(c.claims - 1, 0),
        deferrals = c.deferrals + 1, last_error = p_reason, available_at = v_now + make_interval(secs => v_backoff),
        definition = v_route
    WHERE c.id = v_cmd.id;
    -- The open commands queued behind it on its position follow it (a claim takes none of them without this
    -- position's row, which this transaction holds); available_at is set so that their wake-up names the route.
    UPDATE {{schema}}.commands c SET definition = v_route, available_at = c.available_at
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.position = p_path
                     AND x.state IN ('PENDING', 'DEFERRED', 'PARKED') AND x.definition IS DISTINCT FROM v_route
                   ORDER BY x.id FOR UPDATE);
    PERFORM {{schema}}.append_history(
        p_instance, p_path, 'COMMAND_DEFERRED', v_cmd.step, v_cmd.visit, NULL,
        jsonb_build_object('command', v_cmd.id, 'kind', v_cmd.kind, 'reason', p_reason,
                           'deferrals', v_cmd.deferrals + 1, 'backoff_seconds', v_backoff,
                           'retry_at', v_now + make_interval(secs => v_backoff),
                           'pin', jsonb_build_object('scope', v_inst.definition_scope,
                                                     'definition_id', v_inst.definition_id,
                                                     'version', v_inst.version, 'plan_hash', v_inst.plan_hash)),
        v_now);
    RETURN QUERY SELECT v_cmd.id;
END $$;

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
    -- Its open commands take their mapped steps, and those a deferral routed to the old pin (version 76) go
    -- back to the definition's own key, where the workers of the new version walk them: dead letters too,
    -- which a retry of the instance queues again.
    UPDATE {{schema}}.commands c SET
        step = CASE WHEN c.state <> 'DEAD' AND c.step IS NOT NULL AND p_step_map ? c.step THEN p_step_map->>c.step
                    ELSE c.step END,
        definition = v_inst.definition_id, available_at = c.available_at  -- the wake-up names the definition
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                     AND ((x.state <> 'DEAD' AND x.step IS NOT NULL AND p_step_map ? x.step)
                          OR x.definition IS DISTINCT FROM v_inst.definition_id)
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

CREATE OR REPLACE FUNCTION {{schema}}.claim_heads(p_batch integer, p_lease_seconds double precision, p_worker text,
                                       p_served text[])
RETURNS TABLE (command_id bigint, kind text, command_step text, command_visit integer, name text,
               payload jsonb, attempt integer, claims integer, token uuid, last_error text, actor text,
               instance_id uuid, scope text, definition_id text, version integer, plan_hash text,
               status text, state jsonb, state_version bigint, business_key text, parent_id uuid,
               parent_position text, parent_visit integer, "position" text, position_status text,
               step text, visit integer, wait jsonb, branch_parent text, branch_visit integer,
               branch_name text, branch_item jsonb, context jsonb, instance_created_at timestamptz,
               now timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH clock AS MATERIALIZED (
        -- served: the keys of the work this claim takes, the worker's definition ids and the routes of its pins
        -- (version 76), or from a worker of an earlier release (its ids alone: no key holds '@') those ids and
        -- their routes, which it took work of before; walk: the served keys, or every key that has ready work
        SELECT {{schema}}.db_now() AS now, p_batch AS batch, s.served,
               COALESCE(s.served, {{schema}}.ready_definitions()) AS walk
        FROM (SELECT CASE WHEN strpos(array_to_string(p_served, ' '), '@') > 0 THEN p_served
                          ELSE {{schema}}.served_with_routes(p_served) END AS served) AS s
    ), expired AS (
        SELECT c.id, c.instance_id, c.position, c.available_at, gen_random_uuid() AS token
        FROM {{schema}}.commands c
        JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
        WHERE c.state = 'CLAIMED'
          AND c.available_at <= (SELECT clock.now FROM clock)
          AND (p.lease_until IS NULL OR p.lease_until <= (SELECT clock.now FROM clock))
          AND NOT EXISTS (
              SELECT 1 FROM {{schema}}.commands e
              WHERE e.instance_id = c.instance_id AND e.position = c.position
                AND e.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                AND (e.seq, e.id) < (c.seq, c.id)
                AND NOT (e.kind = 'TIMER' AND e.available_at > (SELECT clock.now FROM clock))
              OFFSET 0)  -- a lookup per candidate, never an anti-join (see above)
          AND ((SELECT clock.served FROM clock) IS NULL
               OR c.definition = ANY ((SELECT clock.served FROM clock)::text[]))  -- an array, not a subquery to ANY
        ORDER BY c.available_at, c.id
        LIMIT (SELECT clock.batch FROM clock)
        FOR UPDATE OF p SKIP LOCKED
    ), ready AS (
        -- Ready work of the walked definitions, each one's own walk through commands_ready, so
        -- that another workflow's backlog is never read. The definition whose oldest ready command is the
        -- oldest is walked first, then the next, until the batch is full: a walk locks no more positions
        -- than the claim keeps (the ones it skips aside), however many definitions the worker serves.
        SELECT r.id, r.instance_id, r.position, r.available_at, r.token
        FROM (
            SELECT s.definition_id, h.available_at
            FROM unnest((SELECT clock.walk FROM clock)::text[]) AS s(definition_id)
            CROSS JOIN LATERAL (
                SELECT c.available_at FROM {{schema}}.commands c
                WHERE c.definition = s.definition_id
                  AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                  AND c.available_at <= (SELECT clock.now FROM clock)
                ORDER BY c.available_at, c.id
                LIMIT 1
            ) AS h
            ORDER BY h.available_at
        ) AS d
        CROSS JOIN LATERAL (
            SELECT c.id, c.instance_id, c.position, c.available_at, gen_random_uuid() AS token
            FROM {{schema}}.commands c
            JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
            WHERE c.definition = d.definition_id
              AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
              AND c.available_at <= (SELECT clock.now FROM clock)
              AND (p.lease_until IS NULL OR p.lease_until <= (SELECT clock.now FROM clock))
              AND NOT EXISTS (
                  SELECT 1 FROM {{schema}}.commands e
                  WHERE e.instance_id = c.instance_id AND e.position = c.position
                    AND e.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                    AND (e.seq, e.id) < (c.seq, c.id)
                    AND NOT (e.kind = 'TIMER' AND e.available_at > (SELECT clock.now FROM clock))
                  OFFSET 0)
            ORDER BY c.available_at, c.id
            LIMIT (SELECT clock.batch FROM clock)
            FOR UPDATE OF p SKIP LOCKED
        ) AS r
        LIMIT (SELECT clock.batch FROM clock)
    ), cand AS (
        -- A plain LIMIT in each branch keeps its plan an index scan; the union is cut here.
        SELECT * FROM (SELECT * FROM expired UNION ALL SELECT * FROM ready)
            AS every_kind LIMIT (SELECT clock.batch FROM clock)
    ), claimed AS (
        UPDATE {{schema}}.commands c SET
            state = 'CLAIMED',
            token = cand.token,
            available_at = (SELECT clock.now FROM clock) + make_interval(secs => p_lease_seconds),
            claimed_by = p_worker,
            claims = c.claims + 1
        FROM cand
        WHERE c.id = cand.id
          -- IS TRUE (see the head of queries.sql): a plan made when ANALYZE found the queue empty read the whole
          -- of commands_position_queue for every candidate here.
          AND (c.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE
          AND c.available_at <= (SELECT clock.now FROM clock)
        RETURNING c.id, c.instance_id, c.position, c.kind, c.step, c.visit, c.name, c.payload, c.attempt, c.claims,
                  c.token, c.last_error, c.actor, c.context, cand.available_at AS queued_at
    ), leased AS (
        UPDATE {{schema}}.positions p SET
            lease_token = claimed.token,
            lease_until = (SELECT clock.now FROM clock) + make_interval(secs => p_lease_seconds),
            lease_owner = p_worker
        FROM claimed
        WHERE p.instance_id = claimed.instance_id AND p.path = claimed.position
        RETURNING p.instance_id, p.path, p.status, p.step, p.visit, p.wait, p.parent_path, p.parent_visit, p.name,
                  p.item
    )
    SELECT claimed.id AS command_id, claimed.kind, claimed.step AS command_step, claimed.visit AS command_visit,
           claimed.name, claimed.payload, claimed.attempt, claimed.claims, claimed.token, claimed.last_error,
           claimed.actor,
           i.id AS instance_id, i.scope, i.definition_id, i.version, i.plan_hash, i.status, i.state,
           i.state_version, i.business_key, i.parent_id, i.parent_position, i.parent_visit,
           leased.path AS position, leased.status AS position_status, leased.step, leased.visit, leased.wait,
           leased.parent_path AS branch_parent, leased.parent_visit AS branch_visit, leased.name AS branch_name,
           leased.item AS branch_item, COALESCE(claimed.context, i.context) AS context, i.created_at AS instance_created_at,
           (SELECT clock.now FROM clock) AS now
    FROM claimed
    JOIN leased ON leased.instance_id = claimed.instance_id AND leased.path = claimed.position
    JOIN {{schema}}.instances i ON i.id = claimed.instance_id
    -- In the order they became claimable (available_at before this claim: an expired lease's is when it ran
    -- out): the worker runs the first suspect alone and gives the others back (runtime/alone.py, migration 0067).
    ORDER BY claimed.queued_at, claimed.id;
END $$;
