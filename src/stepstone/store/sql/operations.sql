-- Named queries of the operations (stepstone.ops): queries, detail, history pages, the probe and the
-- stuck report, retention, repair. {{schema}} is the quoted schema identifier. The `instance_filter`
-- fragment is composed where its name stands in a comment (store/queries.py): one definition of
-- what the filters mean, for the stuck report and the probe; the list and the counts state them in their
-- functions (migration 0064).

-- name: instance_filter
-- $1 statuses, $2 workflow, $3 version, $4 scope, $5 business key, $6 business key contains (a LIKE
-- pattern, escaped by the caller), $7 parent, $8/$9 created since/until, $10/$11 updated since/until,
-- $12 include archived (is_archived, migration 0045: one that changed since shows again). The stuck
-- report and the probe's busy work compose it; the list, the counts and the probe's listing are functions
-- that state the same filters (migration 0064: find_instances and count_instances; 0071: probe_listing),
-- which tests/ops checks against it.
    ($1::text[] IS NULL OR i.status = ANY ($1))
AND ($2::text IS NULL OR i.definition_id = $2)
AND ($3::integer IS NULL OR i.version = $3)
AND ($4::text IS NULL OR i.scope = $4)
AND ($5::text IS NULL OR i.business_key = $5)
AND ($6::text IS NULL OR i.business_key ILIKE $6)
AND ($7::uuid IS NULL OR i.parent_id = $7)
AND ($8::timestamptz IS NULL OR i.created_at >= $8)
AND ($9::timestamptz IS NULL OR i.created_at < $9)
AND ($10::timestamptz IS NULL OR i.updated_at >= $10)
AND ($11::timestamptz IS NULL OR i.updated_at < $11)
AND ($12::boolean OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))

-- name: find_instances
-- Newest first, keyset-paginated on (created_at, id) after ($13, $14); at most $15 rows; the filters $1-$12
-- of instance_filter. The statement is the function's (migration 0064): planned with its arguments on
-- every call, so a filter given reads its index.
SELECT * FROM {{schema}}.find_instances($1::text[], $2::text, $3::integer, $4::text, $5::text, $6::text, $7::uuid,
    $8::timestamptz, $9::timestamptz, $10::timestamptz, $11::timestamptz, $12::boolean, $13::timestamptz,
    $14::uuid, $15::bigint);

-- name: count_instances
-- How many instances of each status match find_instances' filters $1-$12 (its function's twin).
SELECT * FROM {{schema}}.count_instances($1::text[], $2::text, $3::integer, $4::text, $5::text, $6::text, $7::uuid,
    $8::timestamptz, $9::timestamptz, $10::timestamptz, $11::timestamptz, $12::boolean);

-- name: instance_commands
-- Every command of the instance still open or dead, with who recorded it.
SELECT c.id, c.position, c.kind, c.state, c.step, c.visit, c.name, c.attempt, c.claims, c.available_at,
       c.claimed_by, c.last_error, c.actor, c.created_at
FROM {{schema}}.commands c
WHERE c.instance_id = $1 AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
ORDER BY c.id;

-- name: instance_outbox
SELECT o.id, o.event_id, o.type, o.key, o.created_at, o.published_at, o.dead_at, o.attempts, o.last_error
FROM {{schema}}.outbox o WHERE o.instance_id = $1 ORDER BY o.id LIMIT 1000;

-- name: instance_extra
-- The instance's archive time and scope, and of the plan it is pinned to (its plan hash, in the registration
-- its pin was admitted against: a scope may use default's) the sensitive paths and each step's max_attempts.
-- An instance whose plan is not stored (plan_stored false: admitted before its id was registered; the
-- version may since be stored with other code) has no max_attempts, and as sensitive every path a stored
-- plan of its workflow marks (as management.sql's instance_redactions: never less than the version's row).
SELECT CASE WHEN {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at) THEN i.archived_at END AS archived_at,
       i.scope, o.plan IS NOT NULL AS plan_stored,
       CASE WHEN o.plan IS NOT NULL THEN o.plan -> 'sensitive'
            ELSE {{schema}}.stored_sensitive_paths(i.scope, i.definition_scope, i.definition_id, 'sensitive')
       END AS sensitive,
       (SELECT jsonb_object_agg(s ->> 'name', (s -> 'retry' ->> 'max_attempts')::integer)
        FROM jsonb_array_elements(o.plan -> 'steps') s WHERE s ? 'retry') AS max_attempts,
       (SELECT d.plan_hash FROM {{schema}}.definitions d WHERE d.scope = i.definition_scope
          AND d.definition_id = i.definition_id AND d.version = i.version) AS stored_plan_hash,
       i.definition_id, i.version, i.plan_hash
FROM {{schema}}.instances i
LEFT JOIN {{schema}}.definitions o
       ON o.scope = i.definition_scope AND o.definition_id = i.definition_id AND o.version = i.version
      AND o.plan_hash = i.plan_hash
WHERE i.id = $1;

-- name: history_page
-- Entries after seq $2, at most $3; only the kinds $4 when given (core.model.FAILURE_KINDS). The
-- command's kind comes along: the kind it has now, except for a step's own command that became its
-- wait's timer (migration 0035: "the timer in place"). The entries written up to that commit (at or
-- before the row's created_at, which the commit set) ran under what the row was then: the instance's
-- START when it is the instance's first command, else a STEP or a RETRY, which the row no longer tells
-- apart (no kind, rather than a wrong one).
SELECT h.seq, h.at, h.kind, h.position, h.step, h.visit, h.command_id, h.actor, h.data,
       CASE WHEN c.kind = 'TIMER' AND h.at <= c.created_at
            THEN CASE WHEN c.id = (SELECT min(x.id) FROM {{schema}}.commands x WHERE x.instance_id = h.instance_id)
                      THEN 'START' END
            ELSE c.kind END AS command_kind
FROM {{schema}}.history h
LEFT JOIN {{schema}}.commands c ON c.id = h.command_id
WHERE h.instance_id = $1 AND h.seq > $2
  AND ($4::text[] IS NULL OR h.kind = ANY ($4::text[]))
ORDER BY h.seq
LIMIT $3;

-- name: full_history
SELECT h.seq, h.at, h.kind, h.position, h.step, h.visit, h.command_id, h.actor, h.data
FROM {{schema}}.history h WHERE h.instance_id = $1 ORDER BY h.seq;

-- name: probe_columns
-- A command as the probe shows it, with whether it is in flight (CLAIMED under a live lease) and whether
-- an executor could claim it now (the claim's rule: available, PENDING, DEFERRED, or CLAIMED under an
-- expired lease, and probe_free_head). c the command, p its position. The probe's listing states it
-- again in its function (probe_listing, migration 0071), which tests/ops/test_listing_functions.py checks.
c.id, c.instance_id, c.position, c.kind, c.state, c.step, c.attempt, c.available_at, c.created_at,
c.last_error, c.claimed_by,
c.state = 'CLAIMED' AND p.lease_until > {{schema}}.db_now() AS in_flight,
c.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND c.available_at <= {{schema}}.db_now()
AND /*probe_free_head*/ AS claimable

-- name: probe_free_head
-- The command c heads its position's queue (a pending timer not yet due aside) and the position p holds
-- no live lease: a lease is the position's, as for the claim (a continuation in place moves it on without
-- the command's expiry). The lookup is one per command (OFFSET 0), never an anti-join that reads the
-- whole queue (claim_heads does the same).
(p.lease_until IS NULL OR p.lease_until <= {{schema}}.db_now())
AND NOT EXISTS (
    SELECT 1 FROM {{schema}}.commands e
    WHERE e.instance_id = c.instance_id AND e.position = c.position
      AND e.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
      AND (e.seq, e.id) < (c.seq, c.id)
      AND NOT (e.kind = 'TIMER' AND e.available_at > {{schema}}.db_now())
    OFFSET 0)

-- name: open_commands
-- The execution probe's listing of the command log (one instance, $13, or all): every open command with
-- probe_columns' flags, the first $14 by instance, of the instances the filter ($1-$12) keeps. The probe
-- takes its deferred, parked and waiting commands from it, and what is in flight or claimable from
-- busy_commands, which no number of open commands before them hides. The statement is the function's
-- (migration 0071), which states probe_columns and instance_filter again (tests/ops/test_listing_functions.py):
-- planned with its arguments on every call, since its generic plan scans every command. Plain reads: no
-- lock, no transaction held.
SELECT * FROM {{schema}}.probe_listing($1::text[], $2::text, $3::integer, $4::text, $5::text, $6::text, $7::uuid,
    $8::timestamptz, $9::timestamptz, $10::timestamptz, $11::timestamptz, $12::boolean, $13::uuid, $14::bigint);

-- name: busy_commands
-- The probe's busy work, what makes it say "not idle": every command in flight and every one claimable
-- now (probe_columns), of one instance ($13) or all, of the instances the filter ($1-$12) keeps, at most
-- $14. Open commands are mostly the pending timers and parked signals of waiting instances, so a capped
-- read of all of them (open_commands) can miss the busy ones behind; this reads none of those: every
-- CLAIMED command (commands_leased; the ones in flight are few), and the ready ones (PENDING or DEFERRED,
-- available now) walked per definition through commands_ready, as the claim walks them (claim_heads,
-- migration 0042), of the one workflow ($2) when the filter names it, with the routes of its pins that hold
-- ready commands (deferred for want of a plan, migration 0076; ready_routes, migration 0084); each walk stops at $14 claimable commands. The ready walk states commands_ready's predicate alone (`IS TRUE`, see the head of
-- queries.sql), and the claimed branch keeps the flags' test of the state out of its scan (OFFSET 0), so
-- that neither reads commands_position_queue, which holds every pending timer.
SELECT b.id, b.instance_id, b.position, b.kind, b.state, b.step, b.attempt, b.available_at, b.created_at,
       b.last_error, b.claimed_by, b.in_flight, b.claimable
FROM (
    SELECT k.*
    FROM (
        SELECT /*probe_columns*/
        FROM {{schema}}.commands c
        JOIN {{schema}}.instances i ON i.id = c.instance_id
        LEFT JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
        WHERE c.state = 'CLAIMED'
          AND ($13::uuid IS NULL OR c.instance_id = $13)
          AND /*instance_filter*/
        ORDER BY c.available_at, c.id  -- commands_leased's order
        OFFSET 0
    ) AS k
    WHERE k.in_flight OR k.claimable
    UNION ALL
    SELECT r.*
    FROM unnest(CASE WHEN $2::text IS NULL THEN {{schema}}.ready_definitions()
                     ELSE ARRAY[$2::text] || {{schema}}.ready_routes(ARRAY[$2::text]) END)
         AS d(definition)
    CROSS JOIN LATERAL (
        SELECT /*probe_columns*/
        FROM {{schema}}.commands c
        JOIN {{schema}}.instances i ON i.id = c.instance_id
        LEFT JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
        WHERE c.definition = d.definition
          AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
          AND c.available_at <= {{schema}}.db_now()
          AND ($13::uuid IS NULL OR c.instance_id = $13)
          AND /*instance_filter*/
          AND /*probe_free_head*/
        ORDER BY c.available_at, c.id
        LIMIT $14
    ) AS r
) AS b
ORDER BY b.instance_id, b.id
LIMIT $14;

-- name: stuck
-- Commands older than $13 seconds that are still open (a timer counts from its fire time), every dead
-- letter, and every step waiting out a retry backoff, of the instances the filter ($1-$12) keeps; at
-- most $14 rows.
SELECT c.id, c.instance_id, c.position, c.kind, c.state, c.step, c.attempt, c.available_at, c.created_at,
       c.last_error, i.definition_id, i.status AS instance_status,
       CASE WHEN c.state = 'DEAD' THEN 'dead letter'
            WHEN c.state = 'PENDING' AND c.kind IN ('START', 'STEP', 'RETRY') AND c.attempt > 1
                 AND c.available_at > {{schema}}.db_now() THEN 'retrying'
            ELSE 'old' END AS reason
FROM {{schema}}.commands c
JOIN {{schema}}.instances i ON i.id = c.instance_id
WHERE (c.state = 'DEAD'
       OR (c.state = 'PENDING' AND c.kind IN ('START', 'STEP', 'RETRY') AND c.attempt > 1
           AND c.available_at > {{schema}}.db_now())
       OR (c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
           AND CASE WHEN c.kind = 'TIMER' THEN c.available_at ELSE c.created_at END
               < {{schema}}.db_now() - make_interval(secs => $13)))
  AND /*instance_filter*/
ORDER BY c.instance_id, c.id
LIMIT $14;

-- name: retrying
-- Steps of the instance waiting out a retry backoff: which step, which attempt comes next, when.
SELECT c.position, c.step, c.attempt, c.available_at, c.last_error
FROM {{schema}}.commands c
WHERE c.instance_id = $1 AND c.state = 'PENDING' AND c.kind IN ('START', 'STEP', 'RETRY') AND c.attempt > 1
  AND c.available_at > {{schema}}.db_now()
ORDER BY c.position;

-- name: retention_batch
-- $5/$6: only instances of this workflow / scope (NULL: every one; migration 0022).
SELECT last_id, scanned, done, busy, active, unsent, dead, done_ids
FROM {{schema}}.retention_batch($1, $2, $3, $4, $5, $6);

-- name: retention_outbox
SELECT {{schema}}.retention_outbox($1, $2);

-- name: retention_messages
-- Buffered messages past their TTL become EXPIRED (and lose their payload: a trigger, migration 0020),
-- at most $1 a batch; $2: only count them.
WITH due AS (
    SELECT m.id FROM {{schema}}.messages m
    WHERE m.status = 'BUFFERED' AND m.expires_at <= {{schema}}.db_now()
    ORDER BY m.id LIMIT $1 FOR UPDATE SKIP LOCKED
), expired AS (
    UPDATE {{schema}}.messages m SET status = 'EXPIRED' FROM due WHERE m.id = due.id AND NOT $2 RETURNING m.id
)
SELECT CASE WHEN $2 THEN (SELECT count(*) FROM due) ELSE (SELECT count(*) FROM expired) END AS n;

-- name: retention_policies
SELECT workflow, status_class, retain_for, purge_after FROM {{schema}}.retention_policies
ORDER BY workflow = '*' DESC, workflow, status_class;

-- name: set_retention_policy
-- No row when $1 is neither '*' nor a registered workflow (any scope): its policy would never apply.
INSERT INTO {{schema}}.retention_policies (workflow, status_class, retain_for, purge_after)
SELECT $1, $2, $3, COALESCE($4, interval '1 day')
WHERE $1 = '*' OR EXISTS (SELECT 1 FROM {{schema}}.definitions d WHERE d.definition_id = $1)
ON CONFLICT (workflow, status_class) DO UPDATE
SET retain_for = EXCLUDED.retain_for, purge_after = COALESCE($4, {{schema}}.retention_policies.purge_after)
RETURNING workflow, status_class, retain_for, purge_after;

-- name: retention_lock
-- One retention sweep at a time (the worker's loop and the CLI): a session lock on the caller's own
-- connection, taken without waiting. The key is the schema's, offset from the migration lock's.
SELECT pg_try_advisory_lock(hashtextextended('stepstone.retention.' || $1::text, 0));

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtextextended('stepstone.retention.' || $1::text, 0));

-- name: retry_many
-- Retry each instance of $1 (ascending id: the lock order) as actor $2, as a single retry does: a FAILED
-- one's failed step, a COMPENSATION_FAILED one's compensation where it stopped (retry_saga); one row per id,
-- with the instance's parent and its status, which a refused retry of a child names (parent_went_on).
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($2::text, ''), true)),
ids AS (SELECT DISTINCT x.id FROM unnest($1::uuid[]) AS x(id))
SELECT ids.id, (s.r).outcome, (s.r).status, c.parent_id, p.status AS parent_status
FROM ids CROSS JOIN LATERAL (SELECT {{schema}}.retry_saga(ids.id, $2) AS r FROM who OFFSET 0) AS s
LEFT JOIN {{schema}}.instances c ON c.id = ids.id
LEFT JOIN {{schema}}.instances p ON p.id = c.parent_id
ORDER BY ids.id;

-- name: parent_of_child
-- What a refused retry of child $1 (outcome not_awaited) says of its parent, read after the refusal.
SELECT * FROM {{schema}}.parent_of_child($1);

-- name: live_awaited_children
-- The children of $1 still under way that a position of it awaits, which refused its replay (child_live).
SELECT x.id, x.definition_id, x.status, x.parent_position, x.parent_visit FROM {{schema}}.instances x
WHERE x.parent_id = $1 AND x.status IN ('PENDING', 'RUNNING', 'WAITING') AND {{schema}}.child_standing(x) = 'awaited'
ORDER BY x.id;

-- name: cancel_many
-- Cancel each instance of $1 with reason $2 as actor $3, compensating its completed steps first when $4,
-- as a single cancel does (cancel_saga: an instance that ended any way is left unchanged); one row per id.
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($3::text, ''), true)),
ids AS (SELECT DISTINCT x.id FROM unnest($1::uuid[]) AS x(id))
SELECT ids.id, (s.r).outcome, (s.r).status
FROM ids, LATERAL (SELECT {{schema}}.cancel_saga(ids.id, $2, $3, $4::boolean) AS r FROM who OFFSET 0) AS s
ORDER BY ids.id;

-- name: replay
WITH who AS MATERIALIZED (SELECT set_config('stepstone.actor', COALESCE($7::text, ''), true))
SELECT (s.r).outcome, (s.r).status, (s.r).visit
FROM (SELECT {{schema}}.replay_instance($1, $2, $3, $4, $5, $6, $7) AS r FROM who OFFSET 0) AS s;

-- name: command_of
-- The kind, name and payload of the instance $1's command $2 (what led a replayed step there).
SELECT c.kind, c.name, c.payload FROM {{schema}}.commands c WHERE c.instance_id = $1 AND c.id = $2;

-- name: replay_cause
-- In the replay's transaction, the RETRY command replay_instance queued for the visit $2 takes $3 as its
-- payload: what led to the step (core.messages.signal_cause), which the handler is given again.
UPDATE {{schema}}.commands c SET payload = $3
WHERE c.instance_id = $1 AND c.position = '' AND c.kind = 'RETRY' AND c.state = 'PENDING' AND c.visit = $2;

-- name: role_privileges
-- Who this connection is and whether it can change the schema (owner, CREATE, superuser).
SELECT current_user AS role,
       r.rolsuper AS superuser,
       pg_has_role(current_user, n.nspowner, 'USAGE') AS owns_schema,
       has_schema_privilege(current_user, n.oid, 'CREATE') AS can_create
FROM pg_namespace n, pg_roles r
WHERE n.nspname = $1 AND r.rolname = current_user;
