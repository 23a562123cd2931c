-- Named queries of the engine. Each starts with "-- name: <name>"; {{schema}}
-- is replaced by the quoted schema identifier when the file is loaded.
--
-- Commands found by their key test their state as `(c.state = ...) IS TRUE`. A bare state test proves
-- the predicate of a partial queue index (commands_leased, commands_position_queue), and the planner
-- then may read that whole index instead of the key's: whenever the last ANALYZE found the queue
-- empty, the index looks free, however much it holds now (a backlog that came after it, or the entries
-- of every claim since the last vacuum). `IS TRUE` means the same in a WHERE clause and proves nothing,
-- so only the claim's ordered walks use those indexes (docs/performance-history.md, "Lookups by id"; migration
-- 0028 does the same in the commit path). A lookup of one instance's or one position's queued commands
-- names the states of commands_position_queue, the index it should read, and narrows them with IS TRUE.
-- The walks of ready work turn this round: commands_ready's predicate is
-- `(state IN ('PENDING', 'DEFERRED')) IS TRUE`, which only a statement that says exactly that proves, and
-- the claim, `next_available` and the health sample say it, so they read that index and no other partial
-- one (migration 0041).

-- name: claim
-- Claim up to $1 heads of position queues for worker $3 with a lease of $2 seconds; only of the
-- definitions $4 when given. The statement is in the function (migration 0036): its plan must be the
-- generic one on every call, which only a function's own plan_cache_mode can promise, since PostgreSQL
-- otherwise weighs each new generic plan against every custom plan the connection ever made
-- (docs/performance-history.md, "The claim on its generic plan").
SELECT * FROM {{schema}}.claim_heads($1, $2, $3, $4);

-- name: commit_many
-- One or more fenced commits in one statement and one transaction (store/effects.py builds them).
SELECT idx, outcome, continuation, lease_until, committed_at, state_version, state
FROM {{schema}}.commit_decisions($1);

-- name: held_command
-- The command this token holds on the position, and the step and visit it names now.
SELECT c.id, c.step, c.visit FROM {{schema}}.commands c
JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position AND p.lease_token = c.token
WHERE c.instance_id = $1 AND c.position = $2 AND c.token = $3 AND (c.state = 'CLAIMED') IS TRUE;

-- name: queued_behind
-- The commands queued right behind claimed command $3 on position $2 of instance $1, in queue order, up to
-- $4 of them, each with whether it is ready (PENDING and due), and on the first row (or the only one,
-- when none is queued) the instance's state and version: a join's decision takes the ready BRANCH_DONE
-- reports at their head (migration 0037), and decides on a state read in the same snapshot as them, so
-- that it holds every change their branches committed with them. By the queue index, from the claimed
-- command's place in it.
SELECT q.id, q.kind, q.step, q.visit, q.name, q.payload, q.attempt, q.claims, q.last_error, q.actor, q.ready,
       CASE WHEN COALESCE(q.n, 1) = 1 THEN i.state END AS state, i.state_version
FROM {{schema}}.instances i
LEFT JOIN LATERAL (
    SELECT c.id, c.kind, c.step, c.visit, c.name, c.payload, c.attempt, c.claims, c.last_error, c.actor,
           c.state = 'PENDING' AND c.available_at <= {{schema}}.db_now() AS ready,
           row_number() OVER (ORDER BY c.seq, c.id) AS n
    FROM {{schema}}.commands c
    WHERE c.instance_id = $1 AND c.position = $2 AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
      AND (c.seq, c.id) > (SELECT h.seq, h.id FROM {{schema}}.commands h WHERE h.id = $3)
    ORDER BY c.seq, c.id
    LIMIT $4
) q ON true
WHERE i.id = $1
ORDER BY q.n;

-- name: holds_lease
-- Whether this token still holds the position's lease, unexpired, on the database clock.
SELECT EXISTS (SELECT 1 FROM {{schema}}.positions p
               WHERE p.instance_id = $1 AND p.path = $2 AND p.lease_token = $3
                 AND p.lease_until > {{schema}}.db_now());

-- name: settled_by
SELECT EXISTS (SELECT 1 FROM {{schema}}.commands c WHERE c.id = $1 AND c.token = $2 AND c.state <> 'CLAIMED');

-- name: renew
-- Extend the leases this worker still holds; returns the positions it holds.
-- Rows are locked in ascending (instance, path) order first (the lock order), so
-- two workers that both believe they hold the same positions cannot deadlock.
WITH held AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::uuid[]) AS h(instance_id, path, token)
), locked AS (
    SELECT p.instance_id, p.path FROM {{schema}}.positions p
    JOIN held ON held.instance_id = p.instance_id AND held.path = p.path AND p.lease_token = held.token
    ORDER BY p.instance_id, p.path
    FOR UPDATE OF p
), pos AS (
    UPDATE {{schema}}.positions p SET lease_until = {{schema}}.db_now() + make_interval(secs => $4)
    FROM locked
    WHERE p.instance_id = locked.instance_id AND p.path = locked.path
    RETURNING p.instance_id, p.path, p.lease_token, p.lease_until
), cmd AS (
    UPDATE {{schema}}.commands c SET available_at = pos.lease_until
    FROM pos
    WHERE c.instance_id = pos.instance_id AND c.position = pos.path AND c.token = pos.lease_token
      AND (c.state = 'CLAIMED') IS TRUE
    RETURNING c.instance_id
)
SELECT instance_id, path FROM pos;

-- name: release
-- Give a claim back untouched (drain): the command is claimable at once and the
-- claim it spent is restored.
WITH pos AS (
    UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
    WHERE p.instance_id = $1 AND p.path = $2 AND p.lease_token = $3
    RETURNING p.instance_id, p.path
)
UPDATE {{schema}}.commands c SET state = 'PENDING', token = NULL, available_at = {{schema}}.db_now(),
    claims = GREATEST(c.claims - 1, 0),
    -- and so is its mark, when it ran alone (run_alone)
    alone_claims = c.alone_claims - CASE WHEN c.alone_token = $3 THEN 1 ELSE 0 END,
    alone_token = CASE WHEN c.alone_token = $3 THEN NULL ELSE c.alone_token END
FROM pos
WHERE c.instance_id = pos.instance_id AND c.position = pos.path AND c.token = $3 AND (c.state = 'CLAIMED') IS TRUE
RETURNING c.id;

-- name: run_alone
-- The worker runs the command this token holds alone (runtime/alone.py): mark the claim, and return how
-- many earlier claims of the command ran alone and did not commit (its dead letter counts those, migration
-- 0058); no row when the token no longer holds the position's unexpired lease. At most claims - 2 earlier
-- claims ran alone (the first claim of a command never does), which drops the marks of a command settled
-- or rescheduled since (its claims counted again from 0 or 1). Only the command row is updated.
UPDATE {{schema}}.commands c SET alone_claims = LEAST(coalesce(c.alone_claims, 0), GREATEST(c.claims - 2, 0)) + 1,
    alone_token = c.token
FROM {{schema}}.positions p
WHERE p.instance_id = $1 AND p.path = $2 AND p.lease_token = $3 AND p.lease_until > {{schema}}.db_now()
  AND c.instance_id = $1 AND c.position = $2 AND c.token = $3 AND (c.state = 'CLAIMED') IS TRUE
RETURNING c.alone_claims - 1 AS earlier;

-- name: defer
-- This node lacks the pinned plan: hand the command to a node that has it, with
-- backoff min(5 s * 2^deferrals, 5 min), and a COMMAND_DEFERRED history entry (migration 0017).
SELECT command_id AS id FROM {{schema}}.defer_command($1, $2, $3, $4);

-- name: stopped_by
-- Whether a branch's failure stopped the instance: its commit wrote the INSTANCE_FAILED entry of that
-- position's step visit (the commit decides it under the instance's lock, migration 0046), or only a
-- BRANCH_FAILED one, which the join passes over. For the failure's log line, read after that commit.
SELECT EXISTS (SELECT 1 FROM {{schema}}.history h
               WHERE h.instance_id = $1 AND h.position = $2 AND h.step = $3 AND ($4::integer IS NULL OR h.visit = $4)
                 AND h.kind = 'INSTANCE_FAILED');

-- name: note_error
-- A segment crashed: record why on the command its token holds, so the dead
-- letter of a command that keeps crashing names the cause. Only the command row
-- is touched (nothing before it in the lock order is taken).
UPDATE {{schema}}.commands c SET last_error = $3
WHERE c.instance_id = $1 AND c.token = $2 AND (c.state = 'CLAIMED') IS TRUE
RETURNING c.id;

-- name: next_available
-- Seconds from the database clock to the earliest future availability (a queued
-- command's of the definitions $1, or of any when NULL, or a lease's expiry), or NULL. A lease's expiry is
-- the position's: a continuation in place (migration 0030) moves it on without the command's, which
-- the claim and the renewals set. Claimed commands are the ones in flight, few. Each definition's next
-- command is the first entry of its walk of commands_ready (migration 0041), so a worker that
-- names the definitions it serves is not woken by another workflow's timers; with none named, the walked
-- ones are every definition that has queued commands (`ready_definitions`, migration 0042).
SELECT EXTRACT(EPOCH FROM (LEAST(
    (SELECT min(h.available_at)
     FROM unnest(COALESCE($1::text[], (SELECT {{schema}}.ready_definitions()))) AS s(definition)
     CROSS JOIN LATERAL (SELECT c.available_at FROM {{schema}}.commands c
                         WHERE c.definition = s.definition AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                           AND c.available_at > {{schema}}.db_now()
                         ORDER BY c.available_at LIMIT 1) AS h),
    (SELECT p.lease_until FROM {{schema}}.commands c
     JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position AND p.lease_token = c.token
     WHERE c.state = 'CLAIMED' AND p.lease_until > {{schema}}.db_now()
     ORDER BY p.lease_until LIMIT 1)) - {{schema}}.db_now()))::float8;

-- name: statistics_due
-- The engine's hot tables whose statistics lag their size: how many are still young (never analyzed,
-- or last analyzed with fewer than $2 rows), and how many of those are due, holding $1 rows or more
-- and never analyzed or twice the rows their last analysis counted. Until a table is analyzed the
-- planner takes it for nearly empty, and the claim's cached plan read and sorted the whole backlog; a
-- table analyzed small and grown since keeps plans made for its old size: with `commands` analyzed at
-- 300 rows, the claim's re-check of the commands it takes read the whole table (a sequential scan,
-- 1.5 ms a claim at 6,000 rows) until the next ANALYZE (docs/performance-history.md, "Plans made on empty
-- tables", "Plans of a young database"). Autovacuum re-analyzes after a tenth of a table has changed,
-- but only once per nap time (a minute), in which a young table can grow tenfold.
-- `due` names them as regclass prints a name (quoted where needed, qualified unless on the search path)
-- for refresh_statistics to analyze only those: an ANALYZE of the four took 80-120 ms at a few thousand rows each.
-- "Never analyzed" also covers a table that holds rows and has no planner statistics (pg_stats): an
-- ANALYZE whose transaction rolls back (its connection cut before the commit, as the chaos rig's
-- proxy did) loses the statistics it wrote but keeps last_analyze, the reset count of changes and
-- pg_class.reltuples, which are not transactional. Judged by those, the tables looked analyzed at
-- their size, and a young database's claims read and sorted the whole backlog until autovacuum
-- analyzed it a minute later, or never with autovacuum off (docs/performance-history.md, "Statistics lost
-- with their transaction"). A table analyzed empty has none either, and counted 0 rows.
SELECT count(*) FILTER (WHERE t.young) AS young,
       COALESCE(array_agg(t.name ORDER BY t.name)
                    FILTER (WHERE t.young AND t.live >= $1 AND (t.never OR t.live >= 2 * GREATEST(t.counted, 1))), '{}') AS due
FROM (SELECT s.relid::regclass::text AS name, s.n_live_tup AS live, c.reltuples AS counted,
             n.never, n.never OR c.reltuples < $2 AS young
      FROM pg_stat_user_tables s
      JOIN pg_class c ON c.oid = s.relid
      CROSS JOIN LATERAL (SELECT (s.last_analyze IS NULL AND s.last_autoanalyze IS NULL)
                                 OR (c.reltuples > 0 AND NOT EXISTS (SELECT 1 FROM pg_stats p
                                                                     WHERE p.schemaname = s.schemaname
                                                                       AND p.tablename = s.relname))
                                 AS never) AS n
      WHERE s.relid IN ('{{schema}}.instances'::regclass, '{{schema}}.positions'::regclass,
                        '{{schema}}.commands'::regclass, '{{schema}}.history'::regclass)) AS t;

-- name: statistics_lock
-- Taken by the worker that analyzes the hot tables, until its transaction ends; another skips its turn.
SELECT pg_try_advisory_xact_lock(hashtextextended('stepstone.statistics:' || $1::text, 0));

-- name: register_definition
INSERT INTO {{schema}}.definitions (scope, definition_id, version, plan_hash, plan, registered_at)
VALUES ($1, $2, $3, $4, $5, {{schema}}.db_now())
ON CONFLICT (scope, definition_id, version) DO NOTHING;

-- name: definition_hash
SELECT plan_hash FROM {{schema}}.definitions WHERE scope = $1 AND definition_id = $2 AND version = $3;

-- name: start
-- The actor goes to the commands it records too (commands.actor's default reads the setting).
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($12::text, ''), true))
SELECT {{schema}}.start_instance($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) FROM who;

-- name: start_with
-- start, keeping the caller's durable context on the instance ($12, migration 0011) and scheduling an
-- instance deadline (an instant $13 or seconds from now $14, migration 0006) and the start step's
-- deadline ($15 seconds, migration 0016), in one statement.
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($11::text, ''), true))
SELECT {{schema}}.schedule_start_deadlines(
    {{schema}}.start_with_context($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12), $13, $14, $7, $15) FROM who;

-- name: start_batch
-- Many starts of one pinned version in one statement and one transaction (migration 0023).
SELECT idx, instance_id, created
FROM {{schema}}.start_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15);

-- name: business_keys_held
SELECT business_key, id FROM {{schema}}.instances
WHERE scope = $1 AND definition_id = $2 AND business_key = ANY ($3::text[])
LIMIT 1;

-- name: start_key
SELECT fingerprint, target FROM {{schema}}.dedup WHERE kind = 'START' AND namespace = $1 AND key = $2;

-- name: business_key_holder
SELECT id FROM {{schema}}.instances WHERE scope = $1 AND definition_id = $2 AND business_key = $3;

-- name: signal
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($7::text, ''), true))
SELECT (s.r).outcome, (s.r).command_id, (s.r).status
FROM (SELECT {{schema}}.signal_position($1, $2, $3, $4, $5, $6, $7) AS r FROM who OFFSET 0) AS s;

-- name: signal_with_context
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($7::text, ''), true))
SELECT (s.r).outcome, (s.r).command_id, (s.r).status
FROM (SELECT {{schema}}.signal_with_context($1, $2, $3, $4, $5, $6, $7, $8) AS r FROM who OFFSET 0) AS s;

-- name: cancel
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($3::text, ''), true))
SELECT (s.r).outcome, (s.r).status FROM (SELECT {{schema}}.cancel_saga($1, $2, $3, $4) AS r FROM who OFFSET 0) AS s;

-- name: retry
-- With the instance's parent and its status, which a refused retry of a child names (parent_went_on).
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($2::text, ''), true))
SELECT (s.r).outcome, (s.r).status, c.parent_id, p.status AS parent_status
FROM (SELECT {{schema}}.retry_saga($1, $2) AS r FROM who OFFSET 0) AS s
LEFT JOIN {{schema}}.instances c ON c.id = $1
LEFT JOIN {{schema}}.instances p ON p.id = c.parent_id;

-- name: parent_of_child
-- What a refused retry of child $1 (outcome not_awaited) says of its parent, read after the refusal.
SELECT * FROM {{schema}}.parent_of_child($1);

-- name: compensations
SELECT id, position, step, visit, recorded, status, attempts, last_error, completed_at, compensated_at
FROM {{schema}}.compensations WHERE instance_id = $1 ORDER BY id;

-- name: get_instance
SELECT i.id, i.scope, i.definition_id, i.version, i.plan_hash, i.status, i.state, i.step, i.visit,
       (SELECT p.wait FROM {{schema}}.positions p  -- stored once, on the root position (migration 0032)
        WHERE p.instance_id = i.id AND p.path = '' AND p.status = 'WAITING') AS wait,
       i.error, i.business_key, i.parent_id, i.created_at, i.updated_at, i.ended_at,
       CASE WHEN {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at) THEN i.archived_at END AS archived_at,
       (SELECT min(c.available_at) FROM {{schema}}.commands c
        WHERE c.instance_id = i.id AND c.kind = 'TIMER'  -- the queue index, by instance (head of this file)
          AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
       ) AS next_timer_at,
       -- Signals and messages only: a branch's report parked at a failed join (BRANCH_PARKED) is none.
       (SELECT count(*) FROM {{schema}}.commands c
        WHERE c.instance_id = i.id AND c.state = 'PARKED' AND c.kind IN ('SIGNAL', 'MESSAGE')) AS parked_signals,
       i.parent_position,
       (SELECT coalesce(jsonb_agg(jsonb_build_object('path', p.path, 'status', p.status, 'step', p.step,
                                                     'visit', p.visit, 'wait', p.wait, 'error', p.error)
                                  ORDER BY p.path), '[]'::jsonb)
        FROM {{schema}}.positions p WHERE p.instance_id = i.id) AS positions,
       (SELECT coalesce(jsonb_agg(jsonb_build_object('id', k.id, 'definition_id', k.definition_id,
                                                     'status', k.status, 'position', k.parent_position)
                                  ORDER BY k.created_at, k.id), '[]'::jsonb)
        FROM {{schema}}.instances k WHERE k.parent_id = i.id) AS children
FROM {{schema}}.instances i
WHERE i.id = $1;

-- name: instance_status
SELECT status FROM {{schema}}.instances WHERE id = $1;

-- name: list_instances
-- Newest first, keyset-paginated on (created_at, id); every filter optional; archived instances only
-- when $8 (is_archived, as every list). The statement is the function's (migration 0064): planned with
-- its arguments on every call, so a filter given reads its index.
SELECT * FROM {{schema}}.list_instances($1::text, $2::text, $3::text, $4::timestamptz, $5::uuid, $6::bigint,
                                        $7::text, $8::boolean);

-- name: history
-- The root's entries are stored without a position; they say '' (the root's path), as the operations do.
SELECT seq, at, kind, COALESCE(position, '') AS position, step, visit, command_id, actor, data
FROM {{schema}}.history WHERE instance_id = $1 ORDER BY seq;

-- name: db_now
SELECT {{schema}}.db_now();

-- name: move_clock
-- Test hook: shift the database clock every session sees; returns the new time. RETURNING reads the
-- updated row, while db_now() would still read the offset from before this statement.
UPDATE {{schema}}.clock SET offset_by = offset_by + make_interval(secs => $1) RETURNING now() + offset_by;

-- name: clock_offset
-- Test hook: how far (seconds) the database clock is moved from the server's own.
SELECT extract(epoch FROM offset_by)::float8 FROM {{schema}}.clock;

-- name: set_clock_offset
-- Test hook: put the database clock's offset back to $1 seconds (what the testing kit found); returns the new time.
UPDATE {{schema}}.clock SET offset_by = make_interval(secs => $1) RETURNING now() + offset_by;
