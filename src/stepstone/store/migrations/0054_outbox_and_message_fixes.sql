-- The relay's claim walks the pending events in id order on any statistics (docs/performance.md, "The
-- outbox claim on any statistics").
--
-- The claim (outbox.sql, `outbox_claim`) tests each candidate for a key held back (one probe of
-- outbox_pending_key), then takes the first $1 in id order. Planned on statistics that predate a large
-- insert (a fresh database, or before autovacuum's next ANALYZE), the planner took the pending events
-- for a handful, read them all with a bitmap scan, probed every one and sorted them: 262 ms for 50
-- events in the first report, 3.8 s (p50 of 20 claims) with 100,000 events staged in one insert,
-- against 11 ms once the outbox was analyzed (tests/perf/outbox_claim_stats.py). The order the claim
-- needs is the order of outbox_pending, so the statement now runs in a function that plans it with
-- sorts priced out (enable_sort = off): the candidates come from that index in id order and the walk
-- stops at the limit, whatever the statistics say. The price this puts on the plan would have it
-- compiled by JIT (0.7 s, most of a claim), which a statement of index probes never gains from
-- (jit = off). The final ORDER BY id of the 50 rows returned still sorts; nothing else can.
-- Expand only: a function added; older relays keep their own statement.

CREATE FUNCTION {{schema}}.outbox_claim(p_limit integer, p_lease_seconds double precision, p_relay text,
                                        p_token uuid)
RETURNS TABLE (id bigint, event_id uuid, instance_id uuid, type text, key text, payload jsonb,
               trace_context jsonb, created_at timestamptz, attempts integer)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    -- Candidates: pending events below the visibility horizon whose key's oldest unpublished event is
    -- not held back (dead, leased, backing off, above the horizon: outbox.sql's outbox_state is not
    -- 'pending'); then a candidate is dropped when its key has an older unpublished event this claim
    -- did not take. Null keys ask for no order.
    RETURN QUERY
    WITH cand AS (
        SELECT c.id, c.key
        FROM {{schema}}.outbox c
        WHERE c.published_at IS NULL
          AND c.dead_at IS NULL
          AND (c.xid IS NULL OR c.xid < pg_snapshot_xmin(pg_current_snapshot()))
          AND (c.next_attempt_at IS NULL OR c.next_attempt_at <= {{schema}}.db_now())
          AND (c.claimed_until IS NULL OR c.claimed_until <= {{schema}}.db_now())
          AND NOT EXISTS (
              SELECT 1
              FROM (SELECT h.* FROM {{schema}}.outbox h
                    WHERE h.key = c.key AND h.published_at IS NULL
                    ORDER BY h.id LIMIT 1) o
              WHERE o.id < c.id
                AND (o.dead_at IS NOT NULL OR o.claimed_until > {{schema}}.db_now()
                     OR o.next_attempt_at > {{schema}}.db_now()
                     OR o.xid >= pg_snapshot_xmin(pg_current_snapshot())))
        ORDER BY c.id
        LIMIT p_limit
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

-- A repeated start-or-signal answers started = true when its first attempt started the instance
-- (docs/messages.md, "Signal-with-start"). The repeat (the same dedup key, say after a lost answer)
-- found the instance and its signal already recorded and answered started = false: a caller that
-- retried could not tell that its own call had started it. The signal's dedup row now says whether
-- the call that recorded it started the instance, and a duplicate answers that.
-- Expand only: a nullable column added (rows before it read as false), one function replaced whole.
ALTER TABLE {{schema}}.dedup ADD COLUMN started_instance boolean;

CREATE OR REPLACE FUNCTION {{schema}}.start_or_signal_with(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text, p_state jsonb,
    p_step text, p_business_key text, p_start_fingerprint text, p_actor text, p_signal text, p_payload jsonb,
    p_dedup_key text, p_signal_fingerprint text, p_context jsonb, p_deadline_at timestamptz,
    p_deadline_seconds float8, p_start_deadline_seconds float8)
RETURNS TABLE (outcome text, instance_id uuid, started boolean, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_target uuid;
    v_started boolean := false;
    r record;
BEGIN
    SELECT i.id INTO v_target FROM {{schema}}.instances i
    WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
    IF NOT FOUND THEN
        BEGIN
            PERFORM {{schema}}.schedule_start_deadlines(
                {{schema}}.start_with_context(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state, p_step,
                                              p_business_key, NULL, p_start_fingerprint, p_actor, p_context),
                p_deadline_at, p_deadline_seconds, p_step, p_start_deadline_seconds);
            v_target := p_id;
            v_started := true;
        EXCEPTION WHEN unique_violation THEN
            SELECT i.id INTO v_target FROM {{schema}}.instances i
            WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
        END;
    END IF;
    SELECT * INTO r FROM {{schema}}.signal_position(v_target, '', p_signal, p_payload, p_dedup_key,
                                                    p_signal_fingerprint, p_actor);
    IF p_dedup_key IS NOT NULL AND r.outcome = 'recorded' AND v_started THEN
        UPDATE {{schema}}.dedup x SET started_instance = true
        WHERE x.kind = 'SIGNAL' AND x.namespace = v_target::text AND x.key = p_dedup_key;
    ELSIF r.outcome = 'duplicate' THEN  -- this call again: it started the instance if its first attempt did
        v_started := COALESCE((SELECT x.started_instance FROM {{schema}}.dedup x
                               WHERE x.kind = 'SIGNAL' AND x.namespace = v_target::text
                                 AND x.key = p_dedup_key), false);
    END IF;
    RETURN QUERY SELECT r.outcome, v_target, v_started, r.command_id, r.status;
END $$;
