-- Named queries of worker health and metrics (store/observing.py). {{schema}} is the quoted schema.

-- name: sample
-- Queue depth by state, the oldest runnable command's wait and the outbox lag, sampled by one worker at
-- a time: a transaction-scoped advisory lock; a worker that does not get it keeps its last sample (NULL).
SELECT CASE WHEN pg_try_advisory_xact_lock(hashtextextended('stepstone.sample:' || '{{schema}}', 0)) THEN
    jsonb_build_object(
        'states', (SELECT COALESCE(jsonb_object_agg(s.state, s.n), '{}'::jsonb) FROM (
                      SELECT c.state, count(*) AS n FROM {{schema}}.commands c
                      WHERE c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD') GROUP BY c.state) s),
        -- The oldest of each definition's first ready entry in commands_ready (ORDER BY ... LIMIT 1:
        -- a min() over a small table may be planned as a read of a whole queue index,
        -- tests/perf/test_generic_plans.py), the definitions found by `ready_definitions` (migration 0042).
        'oldest_pending_seconds', (SELECT EXTRACT(EPOCH FROM {{schema}}.db_now() - min(h.available_at))::float8
                                   FROM unnest({{schema}}.ready_definitions()) AS s(definition)
                                   CROSS JOIN LATERAL (
                                       SELECT c.available_at FROM {{schema}}.commands c
                                       WHERE c.definition = s.definition AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                                         AND c.available_at <= {{schema}}.db_now()
                                       ORDER BY c.available_at LIMIT 1) AS h),
        'outbox_pending', (SELECT count(*) FROM {{schema}}.outbox o WHERE o.published_at IS NULL),
        'outbox_oldest_seconds', (SELECT EXTRACT(EPOCH FROM {{schema}}.db_now() - min(o.created_at))::float8
                                  FROM {{schema}}.outbox o WHERE o.published_at IS NULL))
END AS sample;

-- name: ping
SELECT 1;
