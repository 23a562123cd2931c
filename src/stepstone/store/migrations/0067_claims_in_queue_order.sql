-- The claim returns its commands in the order they became claimable (available_at before the claim, then
-- id: an expired lease's command is claimable from when its lease ran out, which is its available_at).
--
-- A command claimed again after a claim that ended without a commit (a suspect) runs alone in its worker,
-- and the worker runs the first suspect of its claim and gives the others back (runtime/alone.py; docs/
-- guarantees.md, "Poison command"). The claim's result had no ORDER BY: the suspect a worker ran alone was
-- the claim's accident (on a large table the expired leases, first; on a small one the heap's order). So a
-- suspect that killed its process alone, claimable again when its lease ran out, could come before the
-- suspects that worker had given back before that, and run alone again and again while they waited for
-- its dead letter, `max_claims` deaths later (tests/engine/test_crash_siblings.py). Now the result is
-- sorted (a sort of the batch's rows; the cut's available_at comes back through the claimed UPDATE's
-- RETURNING). The batch is still cut with the expired leases first (a dead worker's work does not queue
-- behind a backlog: docs/guarantees.md, "Resume after a worker dies"), so a claim whose batch the expired
-- leases and older ready work fill without the suspects given back still runs the expired one; measured
-- in docs/performance.md, "The claim in queue order".
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
        -- walk: the definitions whose ready work this claim walks, the served ones or every one that has some
        SELECT {{schema}}.db_now() AS now, p_batch AS batch, p_served AS served,
               COALESCE(p_served, {{schema}}.ready_definitions()) AS walk
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