-- Named queries of schedules and flow limits (store/scheduling.py). {{schema}} is the quoted schema.

-- name: put_schedule
-- Create or replace a schedule (its instances start in scope $6). Re-declaring it unchanged (a deploy
-- calling this at start-up) keeps its next tick; a changed spec or a re-created row starts from the
-- tick given.
INSERT INTO {{schema}}.schedules AS s (name, scope, definition_id, spec, input, next_fire_at, created_at, updated_at)
VALUES ($1, $6, $2, $3, $4, $5, {{schema}}.db_now(), {{schema}}.db_now())
ON CONFLICT (name) DO UPDATE SET
    scope = EXCLUDED.scope,
    definition_id = EXCLUDED.definition_id,
    spec = EXCLUDED.spec,
    input = EXCLUDED.input,
    next_fire_at = CASE WHEN s.spec = EXCLUDED.spec AND s.definition_id = EXCLUDED.definition_id
                        THEN s.next_fire_at ELSE EXCLUDED.next_fire_at END,
    updated_at = EXCLUDED.updated_at
RETURNING (xmax = 0) AS created, next_fire_at;

-- name: list_schedules
-- Every schedule. One schedule by its name is schedule_row, a statement of its own: an optional filter
-- (`$1 IS NULL OR name = $1`) lost its index once the prepared statement took its generic plan after
-- calls of the whole list (a scan of every schedule; docs/performance-history.md, "Listings on their custom plans").
SELECT name, scope, definition_id, spec, input, paused, next_fire_at, last_tick, last_instance, fired, skipped,
       created_at, updated_at
FROM {{schema}}.schedules ORDER BY name;

-- name: schedule_row
SELECT name, scope, definition_id, spec, input, paused, next_fire_at, last_tick, last_instance, fired, skipped,
       created_at, updated_at
FROM {{schema}}.schedules WHERE name = $1;

-- name: pause_schedule
UPDATE {{schema}}.schedules SET paused = true, updated_at = {{schema}}.db_now() WHERE name = $1 RETURNING name;

-- name: resume_schedule
-- Ticks missed while paused are not fired: the schedule goes on from its next tick after now ($2).
UPDATE {{schema}}.schedules SET paused = false, next_fire_at = $2, updated_at = {{schema}}.db_now()
WHERE name = $1 AND paused RETURNING name;

-- name: delete_schedule
DELETE FROM {{schema}}.schedules WHERE name = $1 RETURNING name;

-- name: due_schedules
-- Due schedules of the workflows $2, oldest tick first, but for the schedules $3 (those the caller
-- cannot fire now); read without locks (fire_schedule locks with SKIP LOCKED and re-checks next_fire_at).
-- The scope is the one a start of the schedule's workflow is selected in (select_version).
SELECT name, scope, definition_id, spec, input, next_fire_at, {{schema}}.db_now() AS now
FROM {{schema}}.schedules
WHERE NOT paused AND next_fire_at <= {{schema}}.db_now() AND definition_id = ANY ($2::text[])
  AND name <> ALL ($3::text[])
ORDER BY next_fire_at
LIMIT $1;

-- name: next_schedule
-- Seconds from the database clock to the next tick of a schedule of the workflows $1, or NULL; the
-- schedules $2 (due, but the caller cannot fire them now) are not waited for.
SELECT EXTRACT(EPOCH FROM (min(next_fire_at) - {{schema}}.db_now()))::float8
FROM {{schema}}.schedules WHERE NOT paused AND definition_id = ANY ($1::text[]) AND name <> ALL ($2::text[]);

-- name: fire_schedule
-- The instance deadline ($9 seconds) and the action start step's deadline ($10 seconds) of each instance a
-- tick starts, as a start gives them (migration 0050).
SELECT outcome, instance_id, tick FROM {{schema}}.fire_schedule($1, $2, $3, $4, $5, $6, $7, $8, $9, $10);

-- name: put_flow_limit
-- Set a workflow's limit in a scope ($1), then admit whatever the new limit lets through in every bucket.
WITH lim AS (
    INSERT INTO {{schema}}.flow_limits AS l (scope, definition_id, key_field, max_running, min_interval_seconds,
                                             updated_at)
    VALUES ($1, $2, $3, $4, $5, {{schema}}.db_now())
    ON CONFLICT (scope, definition_id) DO UPDATE SET key_field = EXCLUDED.key_field,
        max_running = EXCLUDED.max_running, min_interval_seconds = EXCLUDED.min_interval_seconds,
        updated_at = EXCLUDED.updated_at
    RETURNING l.definition_id
)
SELECT definition_id FROM lim;

-- name: flow_buckets
SELECT key_value FROM {{schema}}.flow_slots WHERE scope = $1 AND definition_id = $2 ORDER BY key_value
FOR UPDATE;

-- name: flow_admit
SELECT {{schema}}.flow_admit_queued($1, $2, $3, {{schema}}.db_now());

-- name: delete_flow_limit
-- Remove a workflow's limit in a scope ($1): whatever it held back runs now (in start order, as claims find them).
WITH lim AS (
    DELETE FROM {{schema}}.flow_limits WHERE scope = $1 AND definition_id = $2 RETURNING scope, definition_id
), freed AS (
    DELETE FROM {{schema}}.flow_queue q WHERE q.scope = $1 AND q.definition_id = $2
      AND EXISTS (SELECT 1 FROM lim) RETURNING q.instance_id
), started AS (
    UPDATE {{schema}}.commands c SET state = 'PENDING', available_at = {{schema}}.db_now(), last_error = NULL
    FROM freed WHERE c.instance_id = freed.instance_id AND c.kind = 'START' AND c.state = 'DEFERRED'
    RETURNING c.id
), cleared AS (
    UPDATE {{schema}}.instances i SET flow_key = NULL FROM lim
    WHERE i.scope = lim.scope AND i.definition_id = lim.definition_id AND i.flow_key IS NOT NULL
    RETURNING i.id
), slots AS (
    DELETE FROM {{schema}}.flow_slots s USING lim WHERE s.scope = lim.scope AND s.definition_id = lim.definition_id
    RETURNING s.key_value
)
SELECT (SELECT count(*) FROM lim) AS removed, (SELECT count(*) FROM started) AS released,
       (SELECT count(*) FROM cleared) + (SELECT count(*) FROM slots) AS cleaned;

-- name: flow_limits
-- Every scope's limits, or one scope's ($1), or one workflow's ($2), by workflow then scope.
SELECT l.scope, l.definition_id, l.key_field, l.max_running, l.min_interval_seconds,
       COALESCE((SELECT sum(s.running) FROM {{schema}}.flow_slots s
                 WHERE s.scope = l.scope AND s.definition_id = l.definition_id), 0)::bigint AS running,
       (SELECT count(*) FROM {{schema}}.flow_queue q
        WHERE q.scope = l.scope AND q.definition_id = l.definition_id) AS waiting
FROM {{schema}}.flow_limits l
WHERE ($1::text IS NULL OR l.scope = $1) AND ($2::text IS NULL OR l.definition_id = $2)
ORDER BY l.definition_id, l.scope;
