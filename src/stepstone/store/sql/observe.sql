-- Named queries of worker health and metrics (store/observing.py). {{schema}} is the quoted schema.

-- name: sample
-- Queue depth by state, the oldest runnable command's wait, the work no worker can take and the outbox lag,
-- sampled by one worker at a time: a transaction-scoped advisory lock; a worker that does not get it keeps
-- its last sample (NULL). Work no worker can take: the commands of a route (a command deferred for want of
-- its plan, migration 0076) whose pin no worker has served in the last $1 seconds (worker_plans, the rule
-- of the stranded report, `stepstone definitions stranded`): counted apart ('stranded_commands', the wait
-- of the oldest runnable one, 'oldest_stranded_seconds'), since no worker takes them until one with the
-- plan comes back or their instance is migrated; the oldest runnable command is of the rest (it was the
-- oldest of all, so such a command aged it for as long as nobody acted).
SELECT CASE WHEN pg_try_advisory_xact_lock(hashtextextended('stepstone.sample:' || '{{schema}}', 0)) THEN (
    WITH stranded AS MATERIALIZED (
        SELECT r.route FROM unnest({{schema}}.ready_routes(NULL)) AS r(route)
        WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
                          WHERE w.definition_id = split_part(r.route, '@', 1)
                            AND w.version = split_part(r.route, '@', 2)::integer
                            AND w.plan_hash = split_part(r.route, '@', 3)
                            AND w.seen_at > {{schema}}.db_now() - make_interval(secs => $1::float8))
    ), heads AS (
        -- The first ready entry of each key in commands_ready (ORDER BY ... LIMIT 1: a min() over a small
        -- table may be planned as a read of a whole queue index, tests/perf/test_generic_plans.py), the keys
        -- found by `ready_definitions` (migration 0042).
        SELECT s.definition IN (SELECT x.route FROM stranded x) AS stranded, h.available_at
        FROM unnest({{schema}}.ready_definitions()) AS s(definition)
        CROSS JOIN LATERAL (
            SELECT c.available_at FROM {{schema}}.commands c
            WHERE c.definition = s.definition AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
              AND c.available_at <= {{schema}}.db_now()
            ORDER BY c.available_at LIMIT 1) AS h
    )
    SELECT jsonb_build_object(
        'states', (SELECT COALESCE(jsonb_object_agg(s.state, s.n), '{}'::jsonb) FROM (
                      SELECT c.state, count(*) AS n FROM {{schema}}.commands c
                      WHERE c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD') GROUP BY c.state) s),
        'oldest_pending_seconds', (SELECT EXTRACT(EPOCH FROM {{schema}}.db_now() - min(h.available_at))::float8
                                   FROM heads h WHERE NOT h.stranded),
        'stranded_commands', (SELECT COALESCE(sum((SELECT count(*) FROM {{schema}}.commands c  -- a count a route
                                                    WHERE c.definition = x.route
                                                      AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE)), 0)
                              FROM stranded x),
        'oldest_stranded_seconds', (SELECT EXTRACT(EPOCH FROM {{schema}}.db_now() - min(h.available_at))::float8
                                    FROM heads h WHERE h.stranded),
        'outbox_pending', (SELECT count(*) FROM {{schema}}.outbox o WHERE o.published_at IS NULL),
        'outbox_oldest_seconds', (SELECT EXTRACT(EPOCH FROM {{schema}}.db_now() - min(o.created_at))::float8
                                  FROM {{schema}}.outbox o WHERE o.published_at IS NULL)))
END AS sample;

-- name: ping
SELECT 1;
