-- Named queries of the outbox relay. Each starts with "-- name: <name>";
-- {{schema}} is replaced by the quoted schema identifier when the file is loaded.
--
-- An event is pending while published_at and dead_at are both NULL; dead while
-- dead_at is set (kept unpublished until requeued); published once
-- published_at is set. A relay leases the rows it publishes (claim_token,
-- claimed_until on the db clock); a crashed relay's rows come back when the
-- lease expires, so delivery is at least once.

-- name: outbox_claim
-- Lease up to $1 pending events for relay $3 for $2 seconds, in staged (id)
-- order. Only rows whose inserting transaction is older than every running one
-- (xid below the snapshot's xmin): no row of a lower xid can still appear, so
-- what the relay sees below the horizon is final. A row whose key's oldest
-- unpublished event is held back (dead, leased, backing off, above the horizon:
-- its outbox_state is not 'pending') is no candidate, so a key held back with a
-- batch's worth of events behind it does not use up the limit and starve the
-- keys after it. A candidate is then dropped when its key has an older
-- unpublished event that this claim did not take (leased by a claim running
-- beside it, above the horizon); null keys ask for no order and are exempt.
-- The statement is the function's (migration 0054): it walks outbox_pending in
-- id order whatever the statistics say.
SELECT * FROM {{schema}}.outbox_claim($1, $2, $3, $4);

-- name: outbox_settle
-- What became of a leased batch, fenced on the lease token $1: per id $2 an
-- action $3 ('published', 'retry', 'dead' or 'release'), an error $4 and a
-- retry delay in seconds $5; $6 counts the attempt (a broker that could not be
-- reached counts none). Returns the ids settled.
UPDATE {{schema}}.outbox o SET
    published_at = CASE WHEN x.action = 'published' THEN {{schema}}.db_now() END,
    attempts = o.attempts + CASE WHEN x.counted THEN 1 ELSE 0 END,
    last_error = CASE WHEN x.action = 'published' THEN o.last_error ELSE COALESCE(x.error, o.last_error) END,
    next_attempt_at = CASE WHEN x.action = 'retry'
                           THEN {{schema}}.db_now() + make_interval(secs => x.delay) END,
    dead_at = CASE WHEN x.action = 'dead' THEN {{schema}}.db_now() END,
    claim_token = NULL,
    claimed_until = NULL,
    claimed_by = NULL
FROM unnest($2::bigint[], $3::text[], $4::text[], $5::float8[], $6::boolean[])
     AS x(id, action, error, delay, counted)
WHERE o.id = x.id AND o.claim_token = $1
RETURNING o.id;

-- name: outbox_state
-- A fragment, not a statement (composed where its name stands in a comment, store/queries.py): the
-- state of the unpublished event o on the db clock, so `outbox status` counts what `outbox list`
-- names. 'in_flight': under a lease that has not expired (an expired one is claimable again);
-- 'backing_off': its retry time has not come; 'above_horizon': a transaction older than its own still
-- runs, so no claim takes it yet.
CASE
    WHEN o.dead_at IS NOT NULL THEN 'dead'
    WHEN o.claimed_until > {{schema}}.db_now() THEN 'in_flight'
    WHEN o.next_attempt_at > {{schema}}.db_now() THEN 'backing_off'
    WHEN o.xid >= pg_snapshot_xmin(pg_current_snapshot()) THEN 'above_horizon'
    ELSE 'pending'
END

-- name: outbox_status
-- Counts and lag: pending (not published, not dead), of them in flight, backing off and above the
-- visibility horizon (the outbox_state of each), dead letters, the age of the oldest pending
-- event on the db clock (seconds), and that event's last_error: why the outbox waits, e.g. the
-- refusal of a broker that holds every event (a webhook's 401), which counts no attempt and leaves the
-- events pending (the relay settles the oldest first of its key, so it keeps the error).
SELECT
    count(*) FILTER (WHERE s.state <> 'dead') AS pending,
    count(*) FILTER (WHERE s.state = 'in_flight') AS in_flight,
    count(*) FILTER (WHERE s.state = 'backing_off') AS backing_off,
    count(*) FILTER (WHERE s.state = 'above_horizon') AS above_horizon,
    count(*) FILTER (WHERE s.state = 'dead') AS dead,
    extract(epoch FROM {{schema}}.db_now() - min(s.created_at) FILTER (WHERE s.state <> 'dead'))::float8
        AS lag_seconds,
    (SELECT o.last_error FROM {{schema}}.outbox o
     WHERE o.published_at IS NULL AND o.dead_at IS NULL ORDER BY o.id LIMIT 1) AS oldest_pending_error,
    {{schema}}.db_now() AS now
FROM (
    SELECT o.created_at, /*outbox_state*/ AS state
    FROM {{schema}}.outbox o
    WHERE o.published_at IS NULL
) s;

-- name: outbox_published_count
SELECT count(*) FROM {{schema}}.outbox o WHERE o.published_at IS NOT NULL AND o.discarded_at IS NULL;

-- name: outbox_discarded_count
SELECT count(*) FROM {{schema}}.outbox o WHERE o.discarded_at IS NOT NULL;

-- name: outbox_discard
-- Dead events $1 (or every dead event when $2) discarded by an operator: out of the unpublished
-- set for good (their keys resume), marked discarded with the reason $3; returns the ids.
UPDATE {{schema}}.outbox o SET published_at = {{schema}}.db_now(), discarded_at = {{schema}}.db_now(),
    last_error = 'discarded: ' || $3 || COALESCE(' (last error: ' || o.last_error || ')', ''),
    claim_token = NULL, claimed_until = NULL, claimed_by = NULL
WHERE o.published_at IS NULL AND o.dead_at IS NOT NULL
  AND ($2 OR o.id = ANY($1::bigint[]))
RETURNING o.id;

-- name: outbox_list
-- Unpublished events oldest first, dead letters only when $1; at most $2, ids above $3; each with
-- its outbox_state.
SELECT o.id, o.event_id, o.instance_id, o.type, o.key, o.attempts, o.last_error, o.created_at,
       o.dead_at, o.next_attempt_at, o.claimed_by, o.claimed_until, /*outbox_state*/ AS state,
       (o.dead_at IS NULL AND EXISTS (
           SELECT 1 FROM {{schema}}.outbox d
           WHERE d.key = o.key AND d.id < o.id AND d.published_at IS NULL AND d.dead_at IS NOT NULL))
           AS behind_dead
FROM {{schema}}.outbox o
WHERE o.published_at IS NULL
  AND (NOT $1 OR o.dead_at IS NOT NULL)
  AND o.id > $3
ORDER BY o.id
LIMIT $2;

-- name: outbox_requeue
-- Dead events $1 (or every dead event when $2) back to pending, attempts reset.
UPDATE {{schema}}.outbox o SET dead_at = NULL, attempts = 0, next_attempt_at = NULL
WHERE o.published_at IS NULL AND o.dead_at IS NOT NULL
  AND ($2 OR o.id = ANY($1::bigint[]))
RETURNING o.id;

-- name: outbox_unsent_instances
-- The retention guard: of the instances $1 (every instance when NULL), those
-- holding an event that is not published (pending or dead), at most $2.
SELECT DISTINCT o.instance_id
FROM {{schema}}.outbox o
WHERE o.published_at IS NULL
  AND ($1::uuid[] IS NULL OR o.instance_id = ANY($1::uuid[]))
LIMIT $2;

-- name: outbox_unpublished_beside
-- Unpublished events (pending or dead) of instances whose workflow is none of $1 (text[]), or of no
-- instance: what a relay for those workflows alone would take that is not theirs.
SELECT count(*) FROM {{schema}}.outbox o
WHERE o.published_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM {{schema}}.instances i
                  WHERE i.id = o.instance_id AND i.definition_id = ANY($1::text[]));

-- name: outbox_publish_times
-- Test and bench hook: (event id, published_at, created_at) of published events.
SELECT o.event_id, o.published_at, o.created_at FROM {{schema}}.outbox o
WHERE o.published_at IS NOT NULL AND o.discarded_at IS NULL ORDER BY o.id;

-- name: outbox_events_by_id
-- Staged order, key and publish time of the events $1 (uuid[]).
SELECT o.id, o.event_id, o.type, o.key, o.published_at FROM {{schema}}.outbox o
WHERE o.event_id = ANY($1::uuid[]) ORDER BY o.id;
