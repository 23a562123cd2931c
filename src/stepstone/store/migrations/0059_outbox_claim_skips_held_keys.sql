-- The relay's claim skips a key held back with a backlog (docs/performance.md, "The outbox claim on any
-- statistics").
--
-- The claim (outbox.sql, `outbox_claim`, migration 0054) walked the unpublished events in id order and
-- probed each one's key for an older event held back (dead, leased, backing off, above the visibility
-- horizon). One dead event with 100,000 events of its key behind it, older than every other pending
-- event, made each claim walk and probe those 100,000 before it reached a claimable one: about a second
-- a claim, every claim, until an operator requeued or discarded the dead event
-- (tests/perf/outbox_claim_stats.py --held 100000). Now the claim looks at the oldest 4 x limit + 100
-- unpublished events (the first of a key among them is the key's oldest, so one pass says which keys are
-- held back and from where) and takes the claimable ones in id order. Only when those held back fill that
-- window and leave the batch short does it skip: a recursive walk of outbox_pending_key takes each key's
-- oldest unpublished event (one probe a key), the keys whose oldest is claimable in id order, and each
-- one's claimable run from there, with the unkeyed events from a new partial index (migration 0060); the cost is one
-- probe per key with unpublished events, not one per event held back. The locking statement is as
-- before (SKIP LOCKED, then a candidate whose key has an older unpublished event this claim did not take
-- is dropped), so each key's order does not depend on how the candidates were chosen.
-- Expand only: a function added, outbox_claim replaced with the same signature.

-- Whether the unpublished event of these columns is claimable below the horizon p_horizon at p_now (not
-- dead, leased, backing off or above the horizon: outbox.sql's outbox_state is 'pending'). Inlined.
CREATE FUNCTION {{schema}}.outbox_claimable(p_dead_at timestamptz, p_xid xid8, p_next_attempt_at timestamptz,
                                            p_claimed_until timestamptz, p_horizon xid8, p_now timestamptz)
RETURNS boolean LANGUAGE sql IMMUTABLE
AS $$
    SELECT p_dead_at IS NULL AND (p_xid IS NULL OR p_xid < p_horizon)
       AND (p_next_attempt_at IS NULL OR p_next_attempt_at <= p_now)
       AND (p_claimed_until IS NULL OR p_claimed_until <= p_now)
$$;

-- The claim's skip takes the unkeyed events from an index of their own, outbox_pending_unkeyed, which
-- migration 0060 builds without blocking the relays (CONCURRENTLY); until it is there the skip reads them
-- from outbox_pending, which is slower, not wrong.

CREATE OR REPLACE FUNCTION {{schema}}.outbox_claim(p_limit integer, p_lease_seconds double precision, p_relay text,
                                        p_token uuid)
RETURNS TABLE (id bigint, event_id uuid, instance_id uuid, type text, key text, payload jsonb,
               trace_context jsonb, created_at timestamptz, attempts integer)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_window integer := 4 * p_limit + 100;
    v_horizon xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_now timestamptz := {{schema}}.db_now();
    v_seen integer;
    v_ids bigint[];
BEGIN
    -- Candidates, unlocked. First the oldest v_window unpublished events: the first of a key among
    -- them is its oldest, so a key is held back from its first event that is not claimable (dead,
    -- leased, backing off, above the horizon: outbox.sql's outbox_state is not 'pending') on.
    WITH win AS (
        SELECT o.id, o.key,
               {{schema}}.outbox_claimable(o.dead_at, o.xid, o.next_attempt_at, o.claimed_until, v_horizon, v_now)
                   AS ok
        FROM {{schema}}.outbox o
        WHERE o.published_at IS NULL
        ORDER BY o.id
        LIMIT v_window
    ), held AS (
        SELECT w.key, min(w.id) AS since FROM win w WHERE NOT w.ok AND w.key IS NOT NULL GROUP BY w.key
    )
    SELECT (SELECT count(*) FROM win),
           ARRAY(SELECT w.id FROM win w LEFT JOIN held h ON h.key = w.key
                 WHERE w.ok AND (h.since IS NULL OR w.id < h.since) ORDER BY w.id LIMIT p_limit)
    INTO v_seen, v_ids;
    -- Those held back filled the window (a key held back with a backlog behind it, say): rather than
    -- walk the backlog, take each key's oldest event by a skip over outbox_pending_key (one probe a
    -- key with unpublished events), the keys whose oldest is claimable in id order, and each one's
    -- claimable run from there; and the unkeyed events from outbox_pending_unkeyed.
    IF v_seen = v_window AND cardinality(v_ids) < p_limit THEN
        WITH RECURSIVE heads AS (
            (SELECT o.key, o.id, o.dead_at, o.xid, o.next_attempt_at, o.claimed_until FROM {{schema}}.outbox o
             WHERE o.published_at IS NULL AND o.key IS NOT NULL ORDER BY o.key, o.id LIMIT 1)
            UNION ALL
            SELECT n.* FROM heads h, LATERAL (
                SELECT o.key, o.id, o.dead_at, o.xid, o.next_attempt_at, o.claimed_until FROM {{schema}}.outbox o
                WHERE o.published_at IS NULL AND o.key IS NOT NULL AND o.key > h.key
                ORDER BY o.key, o.id LIMIT 1) n
        ), first_keys AS (
            SELECT h.key, h.id FROM heads h
            WHERE {{schema}}.outbox_claimable(h.dead_at, h.xid, h.next_attempt_at, h.claimed_until, v_horizon, v_now)
            ORDER BY h.id
            LIMIT p_limit
        ), runs AS (
            SELECT r.id FROM first_keys f, LATERAL (
                SELECT x.id, bool_and(x.ok) OVER (ORDER BY x.id) AS clear
                FROM (SELECT o.id,
                             {{schema}}.outbox_claimable(o.dead_at, o.xid, o.next_attempt_at, o.claimed_until,
                                                         v_horizon, v_now) AS ok
                      FROM {{schema}}.outbox o
                      WHERE o.key = f.key AND o.published_at IS NULL
                      ORDER BY o.id LIMIT p_limit) x) r
            WHERE r.clear
            UNION ALL
            SELECT u.id FROM (
                SELECT o.id FROM {{schema}}.outbox o
                WHERE o.published_at IS NULL AND o.key IS NULL
                  AND {{schema}}.outbox_claimable(o.dead_at, o.xid, o.next_attempt_at, o.claimed_until,
                                                  v_horizon, v_now)
                ORDER BY o.id LIMIT p_limit) u
        )
        SELECT ARRAY(SELECT r.id FROM runs r ORDER BY r.id LIMIT p_limit) INTO v_ids;
    END IF;
    -- Lock the candidates still claimable, skipping those another claim holds; then a candidate is
    -- dropped when its key has an older unpublished event this claim did not take (whatever chose the
    -- candidates, this keeps each key's order). Null keys ask for no order.
    RETURN QUERY
    WITH cand AS (
        SELECT c.id, c.key
        FROM {{schema}}.outbox c
        WHERE c.id = ANY (v_ids)
          AND c.published_at IS NULL
          AND {{schema}}.outbox_claimable(c.dead_at, c.xid, c.next_attempt_at, c.claimed_until, v_horizon, v_now)
        FOR UPDATE SKIP LOCKED
    ), keep AS (
        SELECT c.id FROM cand c
        WHERE c.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {{schema}}.outbox e
            WHERE e.key = c.key AND e.id < c.id AND e.published_at IS NULL
              AND e.id NOT IN (SELECT x.id FROM cand x))
    ), leased AS (
        UPDATE {{schema}}.outbox o SET
            claim_token = p_token,
            claimed_until = {{schema}}.db_now() + make_interval(secs => p_lease_seconds),
            claimed_by = p_relay
        FROM keep
        WHERE o.id = keep.id
        RETURNING o.id, o.event_id, o.instance_id, o.type, o.key, o.payload, o.trace_context,
                  o.created_at, o.attempts
    )
    SELECT * FROM leased ORDER BY leased.id;
END $$;
