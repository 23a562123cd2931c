-- A claim walks a served route only when the route holds ready work.
--
-- Since 0076 a worker names, after its definition ids, the route of each pin it has
-- (`definition_id@version@plan_hash`), and the claim probed commands_ready once for each of them, as for an
-- id: one more `LIMIT 1` probe a pin on every claim, of a key that is empty unless a worker lacking the
-- plan deferred something. On the bench's registry (five workflows, five pins) the heads' probe ran 10
-- times (21 buffers) for the 5 keys that could hold work, and it grows with the pins a worker has.
--
-- Now the routed ready commands have a partial index of their own, commands_routed, which holds only
-- PENDING and DEFERRED commands whose key is a route (a definition id never holds '@'): those a deferral
-- moved and what continues in their rows; a start, a signal or a timer is queued under its definition id.
-- The claim's walk keeps the served ids, and a served route only when something is routed at all (the
-- index's first entry: one probe of an empty index when nothing is) and that route holds a ready command
-- (a probe of the index by the route): the same commands in the same order as before, since a route
-- without ready commands gave nothing to the walk, and the two reads are in the claim's snapshot. A claim
-- given no served list walks ready_definitions() as before. Both reads are `ORDER BY definition LIMIT 1`,
-- so that their plan is the index's on a small table as on a large one (an EXISTS was planned as a scan of
-- the table on the bench's 300 commands, the predicate's `strpos` taken to keep a third of the rows). The
-- look-up of the next due time (queries.sql, next_available), which a worker makes only when it is idle,
-- still probes every served key.
--
-- The routes of a definition that hold ready work had two spellings since 0076: served_with_routes kept the
-- keys of ready_definitions() with `strpos(k, '@') > 0 AND split_part(k, '@', 1) = ANY (ids)`, and the
-- probe's busy read (operations.sql, busy_commands) those with `left(k, length(id) + 1) = id || '@'`. Both
-- call ready_routes(ids) now, which finds them in commands_routed (one probe a route that holds ready work,
-- and one more) where ready_definitions() took one probe of commands_ready for every key with ready work:
-- the same routes (a definition id holds no '@', so both tests kept the keys `id@...`).
--
-- The index, commands_routed, is built CONCURRENTLY by migration 0084, before this one: workers keep
-- claiming and committing while it builds. Its predicate is written as commands_ready's is, `(state IN
-- ('PENDING', 'DEFERRED')) IS TRUE`, then the route test, and only the claim and ready_routes say both, so
-- nothing else reads it.

-- The routes (command_route) that hold PENDING or DEFERRED commands, of the definitions p_definitions (every
-- one's when NULL), in order: one probe of commands_routed a route and one more, as ready_definitions()
-- walks commands_ready.
CREATE FUNCTION {{schema}}.ready_routes(p_definitions text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        WITH RECURSIVE r AS (
            (SELECT c.definition FROM {{schema}}.commands c
             WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND strpos(c.definition, '@') > 0
             ORDER BY c.definition LIMIT 1)
            UNION ALL
            SELECT (SELECT c.definition FROM {{schema}}.commands c
                    WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND strpos(c.definition, '@') > 0
                      AND c.definition > r.definition
                    ORDER BY c.definition LIMIT 1)
            FROM r WHERE r.definition IS NOT NULL
        )
        SELECT COALESCE(array_agg(r.definition), '{}') FROM r
        WHERE r.definition IS NOT NULL
          AND (p_definitions IS NULL OR split_part(r.definition, '@', 1) = ANY (p_definitions)));
END $$;


-- A served list of definition ids alone (a worker of a release before version 76) with the routes of those
-- definitions: each recorded version's, and each one that has ready work (ready_routes, version 85). Such a
-- worker claims routed commands as it claimed every command of its definitions before, and defers those it
-- lacks again.
CREATE OR REPLACE FUNCTION {{schema}}.served_with_routes(p_served text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_served IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN p_served || ARRAY(
        SELECT {{schema}}.command_route(d.definition_id, d.version, d.plan_hash)
        FROM {{schema}}.definitions d WHERE d.definition_id = ANY (p_served)
        UNION
        SELECT r.k FROM unnest({{schema}}.ready_routes(p_served)) AS r(k));
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
        -- their routes, which it took work of before; walk: the served ids and those served routes that hold
        -- ready commands, or every key that has ready work. Whether a route holds any is a probe of
        -- commands_routed (version 85), after one probe that finds the index empty when nothing is routed:
        -- no probe of commands_ready for a route that holds nothing (the predicate's two tests, as written in
        -- the index, are what let these read it)
        SELECT {{schema}}.db_now() AS now, p_batch AS batch, s.served,
               CASE WHEN s.served IS NULL THEN {{schema}}.ready_definitions()
                    ELSE ARRAY(SELECT u.k FROM unnest(s.served) WITH ORDINALITY AS u(k, n)
                               WHERE strpos(u.k, '@') = 0
                                  OR ((SELECT c.definition FROM {{schema}}.commands c
                                       WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                                         AND strpos(c.definition, '@') > 0
                                       ORDER BY c.definition LIMIT 1) IS NOT NULL
                                      AND (SELECT c.definition FROM {{schema}}.commands c
                                           WHERE c.definition = u.k AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                                             AND strpos(c.definition, '@') > 0
                                           ORDER BY c.definition LIMIT 1) IS NOT NULL)
                               ORDER BY u.n) END AS walk
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
