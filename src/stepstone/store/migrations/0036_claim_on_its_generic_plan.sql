-- The claim on its generic plan, always: a function that sets plan_cache_mode for the claim alone.
--
-- The claim was one prepared statement, written so that its custom and generic plans cost the same (its
-- batch size and served definitions go through the clock CTE, so no plan knows them): PostgreSQL then
-- keeps the generic plan after five custom ones. But it decides that against the average cost of every
-- custom plan the statement has had on that connection, and a claim's estimated cost grows with the
-- queue. A worker that claimed while the tables were small (every worker that starts on an idle system)
-- compares each new generic plan, made after an ANALYZE of the grown tables, with an average that its
-- first cheap plans hold down, finds it dearer, and plans the claim anew on every call until the average
-- catches up: 305 custom plans in 305 claims after three rounds of 10,000 queued starts and ANALYZE,
-- where a fresh connection took 5 (the same plan either way: generic and custom cost 5,776, 11,822 and
-- 17,232). Planning the claim costs about 1 ms, its execution 0.2-0.7 ms. In the worker of
-- tests/perf/ab_throughput.py 297-321 of about 790 claims were planned anew in three of five runs.
--
-- `SET plan_cache_mode = force_generic_plan` on the function applies to the statements it runs and to
-- nothing else on the connection (the operators' listings keep their custom plans, which their optional
-- filters need). The claim's statement is unchanged; its parameters are the function's arguments. A
-- worker of the previous release sends the statement itself, so it runs on unchanged beside this one
-- during a rolling deploy. Measured in docs/performance.md, "The claim on its generic plan".
--
-- Claim up to p_batch heads of position queues for worker p_worker with a lease of
-- p_lease_seconds. Commands whose lease expired (their worker died) come first, then
-- ready work oldest first, so recovery never waits behind a backlog. The
-- position row is the mutex (FOR UPDATE SKIP LOCKED): the branches of one
-- instance are claimed independently. The command update re-checks its state,
-- so a command settled since the snapshot is not claimed, and the lease is
-- taken only for commands actually claimed.
-- The two branches repeat the queue-head rule on purpose: each needs its own
-- index scan and LIMIT (a SQL function holding the rule cost 392 vs 595-633 workflows/s).
-- The rule is a lookup per candidate, in the queue index by (instance, position): `OFFSET 0`
-- keeps its NOT EXISTS a correlated subquery. As an anti-join, the plan made when the last
-- ANALYZE found the queue empty read the whole queue index for every candidate: 66 ms a
-- claim with 20,000 ready commands that came after that ANALYZE, 0.9 ms as a subquery
-- (docs/performance.md, "Lookups by id").
-- The clock is read once per claim (the clock CTE, used through scalar subqueries, which the plans
-- evaluate once): db_now() in each filter ran once per row and call site (issue 17, docs/performance.md).
-- The batch size goes through the same CTE so that no plan knows it: with a bare `LIMIT` of it every
-- custom plan (LIMIT 8) looked cheaper than the generic one, PostgreSQL re-planned the claim on every
-- call, and planning cost ten times the execution (2.7 ms vs 0.3 ms a claim at 50,000 waiting
-- instances). With the limit hidden, custom and generic plans cost the same and the generic one is
-- kept after five calls. The served definitions (p_served) go through it too: a NULL let every custom
-- plan drop the filter and look cheaper than the generic one, so a claim without them was planned
-- anew on every call (1.34-1.40 ms against 0.24 ms with them, 1,000 waiting instances).
-- p_served, when given, is the definition ids the worker serves: it never claims another workflow's work.
-- A worker that claimed everything deferred what it could not run (backoff 5 s, doubling), and in a
-- fleet where workers serve different workflows it kept winning the race for the others' commands
-- that the serving workers' heartbeats made claimable again: an instance waited a heartbeat per lost
-- race (over 60 s seen with two idle workers). A worker that knows the definition but not the pinned
-- version still claims and defers (a rolling deploy, invariant 7). A scalar subquery, not EXISTS: under
-- the OR, EXISTS became a hashed subplan over every instance (a sequential scan); this is one primary
-- key lookup per candidate row.
CREATE FUNCTION {{schema}}.claim_heads(p_batch integer, p_lease_seconds double precision, p_worker text,
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
        SELECT {{schema}}.db_now() AS now, p_batch AS batch, p_served AS served
    ), expired AS (
        SELECT c.id, c.instance_id, c.position, gen_random_uuid() AS token
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
               OR (SELECT i.definition_id FROM {{schema}}.instances i WHERE i.id = c.instance_id)
                  = ANY ((SELECT clock.served FROM clock)::text[]))  -- an array, not a subquery to ANY
        ORDER BY c.available_at, c.id
        LIMIT (SELECT clock.batch FROM clock)
        FOR UPDATE OF p SKIP LOCKED
    ), ready AS (
        SELECT c.id, c.instance_id, c.position, gen_random_uuid() AS token
        FROM {{schema}}.commands c
        JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
        WHERE c.state IN ('PENDING', 'DEFERRED')
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
               OR (SELECT i.definition_id FROM {{schema}}.instances i WHERE i.id = c.instance_id)
                  = ANY ((SELECT clock.served FROM clock)::text[]))  -- an array, not a subquery to ANY
        ORDER BY c.available_at, c.id
        LIMIT (SELECT clock.batch FROM clock)
        FOR UPDATE OF p SKIP LOCKED
    ), cand AS (
        -- A plain LIMIT in each branch keeps both plans index scans; the union is cut here.
        SELECT * FROM (SELECT * FROM expired UNION ALL SELECT * FROM ready) AS both_kinds LIMIT (SELECT clock.batch FROM clock)
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
                  c.token, c.last_error, c.actor, c.context
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
    JOIN {{schema}}.instances i ON i.id = claimed.instance_id;
END $$;
