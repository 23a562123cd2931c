-- Named queries of external tasks (migration 0010). Each starts with "-- name: <name>";
-- {{schema}} is replaced by the quoted schema identifier when the file is loaded.

-- name: external_fetch
-- Lock up to $2 fetchable tasks of the topics $1 for worker $3 for $4 seconds, oldest available
-- first, each with its own token. SKIP LOCKED: concurrent fetches take disjoint tasks and never
-- wait. A candidate whose position no longer waits for it (a cancelled branch or instance) is
-- closed instead (returned with locked = false). While locked, available_at is the lock's expiry.
WITH cand AS (
    SELECT t.id, EXISTS (
        SELECT 1 FROM {{schema}}.positions p
        WHERE p.instance_id = t.instance_id AND p.path = t.position AND p.status = 'WAITING'
          AND p.step = t.step AND p.visit = t.visit) AS awaited
    FROM {{schema}}.external_tasks t
    WHERE t.status = 'OPEN' AND t.topic = ANY($1::text[]) AND t.available_at <= {{schema}}.db_now()
    ORDER BY t.available_at, t.id
    LIMIT $2
    FOR UPDATE OF t SKIP LOCKED
), closed AS (
    UPDATE {{schema}}.external_tasks t SET status = 'CANCELLED', last_error = 'NOT_AWAITED',
        updated_at = {{schema}}.db_now(), ended_at = {{schema}}.db_now()
    FROM cand WHERE t.id = cand.id AND NOT cand.awaited
    RETURNING t.id
), locked AS (
    UPDATE {{schema}}.external_tasks t SET
        lock_token = gen_random_uuid(), lock_owner = $3,
        lock_until = {{schema}}.db_now() + make_interval(secs => $4),
        available_at = {{schema}}.db_now() + make_interval(secs => $4),
        locks = t.locks + 1, updated_at = {{schema}}.db_now()
    FROM cand WHERE t.id = cand.id AND cand.awaited
    RETURNING t.id, t.instance_id, t.position, t.step, t.visit, t.topic, t.payload, t.lock_token, t.lock_until,
              t.retries, t.attempts, t.last_error, t.created_at
)
SELECT true AS locked, l.id, l.instance_id, l.position, l.step, l.visit, l.topic, l.payload, l.lock_token,
       l.lock_until, l.retries, l.attempts, l.last_error, l.created_at, i.definition_id, i.version, i.business_key
FROM locked l JOIN {{schema}}.instances i ON i.id = l.instance_id
UNION ALL
SELECT false, c.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM closed c
ORDER BY 1 DESC, 14, 2;

-- name: external_extend
-- Extend the lock of task $1 held by token $2 to $3 seconds from now; refused once expired.
WITH t AS (
    SELECT x.status, x.lock_token, x.lock_until FROM {{schema}}.external_tasks x WHERE x.id = $1
), done AS (
    UPDATE {{schema}}.external_tasks x SET
        lock_until = {{schema}}.db_now() + make_interval(secs => $3),
        available_at = {{schema}}.db_now() + make_interval(secs => $3),
        updated_at = {{schema}}.db_now()
    WHERE x.id = $1 AND x.lock_token = $2 AND x.status = 'OPEN' AND x.lock_until > {{schema}}.db_now()
    RETURNING x.lock_until
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM done) THEN 'extended'
            WHEN NOT EXISTS (SELECT 1 FROM t) THEN 'not_found'
            WHEN (SELECT t.lock_token FROM t) IS DISTINCT FROM $2 THEN 'lock_lost'
            WHEN (SELECT t.status FROM t) <> 'OPEN' THEN 'not_open'
            ELSE 'lock_expired' END AS outcome,
       (SELECT done.lock_until FROM done) AS lock_until,
       (SELECT t.status FROM t) AS status;

-- name: external_answer
SELECT * FROM {{schema}}.answer_external_task($1, $2, $3, $4, $5, $6, $7, $8);

-- name: external_list
-- Tasks oldest first, of topic $1 (any when NULL), status $2 (any when NULL), instance $3 (any when NULL),
-- after the row (created_at $5, id $6) when a page cursor gave one. The function (migration 0066) plans its
-- statement with the arguments on every call, so a topic or an instance finds its index.
SELECT * FROM {{schema}}.external_list($1::text, $2::text, $3::uuid, $4::bigint, $5::timestamptz, $6::uuid);

-- name: external_get
SELECT t.*, {{schema}}.db_now() AS now FROM {{schema}}.external_tasks t WHERE t.id = $1;
