-- Named queries of `stepstone bench` (not used by the engine). Each starts with
-- "-- name: <name>"; {{schema}} is replaced by the quoted schema identifier.

-- name: ceiling_setup
-- $1 instances, each holding one CLAIMED command under its lease, as a running
-- instance between two steps looks. Ids are md5(n)::uuid so pgbench can address them.
WITH inst AS (
    INSERT INTO {{schema}}.instances (id, definition_id, version, plan_hash, status, state, step, visit,
                                      next_seq, history_seq, lease_token, lease_until, lease_owner,
                                      created_at, updated_at)
    SELECT md5(g::text)::uuid, 'bench_ceiling', 1, 'ceiling', 'RUNNING',
           jsonb_build_object('n', 0, 'payload', repeat('x', 80)), 'one', 1, 2, 1,
           md5('t' || g)::uuid, now() + interval '1 day', 'pgbench', now(), now()
    FROM generate_series(1, $1::integer) AS g
    RETURNING id, lease_token
)
INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, claims, available_at, token,
                                 claimed_by, created_at)
SELECT id, 1, 'START', 'CLAIMED', 'one', 1, 1, now() + interval '1 day', lease_token, 'pgbench', now()
FROM inst;

-- name: ceiling_script
-- pgbench: the writes of one step commit as one statement. The fenced update of
-- the instance, the settle of its claimed command, the next command (already
-- claimed) and the STEP_COMPLETED history row; every write depends on the fence.
\set n random(1, :instances)
WITH i AS (
    UPDATE {{schema}}.instances SET
        state = jsonb_set(state, '{n}', to_jsonb((state->>'n')::integer + 1)),
        step = 'one', visit = visit + 1, history_seq = history_seq + 1, next_seq = next_seq + 1,
        lease_until = now() + interval '1 day', updated_at = now()
    WHERE id = md5(:n::text)::uuid AND lease_token = md5('t' || :n)::uuid
    RETURNING id, visit, history_seq, lease_token
), s AS (
    UPDATE {{schema}}.commands c SET state = 'COMPLETE', settled_at = now()
    FROM i
    WHERE c.instance_id = i.id AND c.token = i.lease_token AND c.state = 'CLAIMED'
    RETURNING c.seq
), n AS (
    INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, claims, available_at, token,
                                     claimed_by, created_at)
    SELECT i.id, s.seq, 'STEP', 'CLAIMED', 'one', i.visit, 1, now() + interval '1 day', i.lease_token,
           'pgbench', now()
    FROM i, s
    RETURNING id
)
INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, data)
SELECT i.id, i.history_seq, now(), 'STEP_COMPLETED', 'one', i.visit - 1, n.id,
       '{"attempt": 1, "patch": [{"op": "replace", "path": "/n", "value": 1}]}'::jsonb
FROM i, n;

-- name: seed_waiting_instances
-- Instances $1..$2 waiting as the engine leaves them: even ones on a timer,
-- odd ones on a signal wait with a timeout; pinned to ($3, $4, $5).
-- Their ids are UUIDv7 as the client makes them (stepstone/ids.py), instance g started at millisecond g
-- after 2023-11-14: older than any instance the workload starts, so they fill the indexes' left side.
INSERT INTO {{schema}}.instances (id, definition_id, version, plan_hash, status, state, step, visit,
                                  next_seq, history_seq, created_at, updated_at)
SELECT (lpad(to_hex(1700000000000 + g), 12, '0') || '7' || substr(md5('w' || g), 14, 3) || '8' || substr(md5('w' || g), 18, 15))::uuid, $3, $4, $5, 'WAITING',
       jsonb_build_object('n', g, 'payload', repeat('x', 80)),
       CASE WHEN g % 2 = 0 THEN 'sleep' ELSE 'await' END, 2,
       3, 3, now(), now()
FROM generate_series($1::bigint, $2::bigint) AS g;

-- name: seed_waiting_positions
-- Their root positions, waiting where the instances wait, on what the step waits for; in the instances'
-- order, as each start writes its position after the previous start's (the semi-join's hash gives them in
-- no order, which left positions_pkey's pages about 63% full where the engine's are about 90%).
INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, wait, created_at, updated_at)
SELECT i.id, '', 'WAITING', i.step, i.visit,
       CASE WHEN i.step = 'sleep'
            THEN '{"kind": "timer", "delay_seconds": 2592000.0, "until": null}'::jsonb
            ELSE '{"kind": "signal", "signals": {"go": "last"}, "timeout_seconds": 2592000.0}'::jsonb END,
       i.created_at, i.updated_at
FROM {{schema}}.instances i
WHERE i.id IN (SELECT (lpad(to_hex(1700000000000 + g), 12, '0') || '7' || substr(md5('w' || g), 14, 3) || '8' || substr(md5('w' || g), 18, 15))::uuid FROM generate_series($1::bigint, $2::bigint) AS g)
ORDER BY i.id;

-- name: seed_waiting_commands
-- Their pending timer (fire or timeout), for instances $1..$2: the first segment's claimed START turned
-- into the timer (migration 0035), so it keeps that claim's token and a seq past the START's.
INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, name, claims, available_at,
                                 token, created_at)
SELECT (lpad(to_hex(1700000000000 + g), 12, '0') || '7' || substr(md5('w' || g), 14, 3) || '8' || substr(md5('w' || g), 18, 15))::uuid, 2, 'TIMER', 'PENDING', CASE WHEN g % 2 = 0 THEN 'sleep' ELSE 'await' END, 2,
       CASE WHEN g % 2 = 0 THEN 'fire' ELSE 'timeout' END, 0, now() + interval '30 days', md5('s' || g)::uuid,
       now()
FROM generate_series($1::bigint, $2::bigint) AS g;

-- name: seed_waiting_history
-- INSTANCE_STARTED, STEP_COMPLETED and WAITING, as their first segment wrote them: the start's entry
-- holds the baseline state and has no actor, no command and no position, the segment's name the
-- worker that committed it (an id of the default's shape, host:pid:hex6, one of eight) and the command
-- it ran, which is the timer now (seeded above, before these).
INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
SELECT c.instance_id, k.seq, now(), k.kind, k.step, k.visit,
       CASE WHEN k.seq > 1 THEN c.id END,
       CASE WHEN k.seq > 1
            THEN '{"kind":"worker","id":"stepstone-worker-' || g % 8 || ':4242:' || substr(md5('k' || g % 8), 1, 6) || '"}'
       END,
       CASE k.seq
           WHEN 1 THEN jsonb_build_object('state', jsonb_build_object('n', g, 'payload', repeat('x', 80)))
           WHEN 2 THEN '{"attempt": 1, "patch": [{"op": "replace", "path": "/n", "value": 1}]}'::jsonb
           ELSE '{"kind": "timer", "delay_seconds": 2592000.0, "until": null}'::jsonb END,
       CASE WHEN k.seq > 1 THEN '' END
FROM generate_series($1::bigint, $2::bigint) AS g
JOIN {{schema}}.commands c
  ON c.instance_id = (lpad(to_hex(1700000000000 + g), 12, '0') || '7' || substr(md5('w' || g), 14, 3) || '8' || substr(md5('w' || g), 18, 15))::uuid
 AND c.seq = 2,
     (VALUES (1, 'INSTANCE_STARTED', 'first', 1), (2, 'STEP_COMPLETED', 'first', 1),
             (3, 'WAITING', 'sleep', 2)) AS k(seq, kind, step, visit)
ORDER BY g, k.seq;

-- name: relation_bytes
-- Bytes on disk of each table a waiting instance has rows in: its rows (TOAST included), its indexes.
SELECT t.name, pg_table_size(format('{{schema}}.%I', t.name)::regclass) AS rows,
       pg_indexes_size(format('{{schema}}.%I', t.name)::regclass) AS indexes
FROM unnest(ARRAY['instances', 'positions', 'commands', 'history']) AS t(name)
ORDER BY t.name;

-- name: wal_position
SELECT pg_current_wal_lsn()::text;

-- name: wal_bytes_since
-- WAL written server-wide since position $1 (autovacuum and checkpoints included).
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint;

-- name: analyze
-- The steady state after a seed: every table a workload seeds has statistics (tasks: the api workload's).
ANALYZE {{schema}}.instances, {{schema}}.positions, {{schema}}.commands, {{schema}}.history, {{schema}}.tasks;

-- name: held_count
SELECT count(*) FROM {{schema}}.instances
WHERE lease_owner = $1 AND lease_until > {{schema}}.db_now() AND status = 'RUNNING';

-- name: unfinished_count
SELECT count(*) FROM {{schema}}.instances WHERE definition_id = $1 AND status <> 'COMPLETED';

-- name: hot_updates
SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
WHERE schemaname = $1 AND relname IN ('instances', 'commands') ORDER BY relname;

-- name: create_database
-- A fresh database for one workload; {{database}} is composed in by sqlfiles.render_identifier.
CREATE DATABASE {{database}};

-- name: drop_database
DROP DATABASE IF EXISTS {{database}} WITH (FORCE);

-- name: server_settings
-- What the report says about the server the numbers come from.
SELECT version() AS version, current_setting('synchronous_commit') AS synchronous_commit,
       current_setting('fsync') AS fsync;

-- name: stage_events
-- The outbox rows step commits stage: $1 events of type $3 for one instance, keys cycling over $2
-- keys (as commit_segment inserts them); returns their event ids.
INSERT INTO {{schema}}.outbox (event_id, instance_id, type, key, payload, created_at)
SELECT gen_random_uuid(), gen_random_uuid(), $3, 'k' || (g % $2), jsonb_build_object('n', g), now()
FROM generate_series(1, $1) AS g
RETURNING event_id::text;

-- name: instance_span
-- Status of instance $1 and, once it ended, seconds from its start to its end on the server's clock.
SELECT status, extract(epoch FROM ended_at - created_at)::float8 AS seconds
FROM {{schema}}.instances WHERE id = $1::uuid;

-- name: branch_share
-- Who ran the branch steps of instance $1 (step $2, settled): claimed_by, and how many.
SELECT coalesce(claimed_by, '?') AS worker, count(*) AS steps
FROM {{schema}}.commands
WHERE instance_id = $1::uuid AND position <> '' AND step = $2 AND state = 'COMPLETE'
GROUP BY 1 ORDER BY 1;

-- name: branch_attempts
-- STEP_COMPLETED history rows of step $2 in instance $1 (one per committed branch step).
SELECT count(*) FROM {{schema}}.history WHERE instance_id = $1::uuid AND kind = 'STEP_COMPLETED' AND step = $2;
