-- A negative, NaN, infinite or too long ttl was refused by the client only.
--
-- The client refuses a ttl outside 0 to a thousand years (core.timestamps.MAX_SECONDS) and one under a
-- microsecond (InvalidInput). Migration 0078 made publish_message refuse the latter too; the others still
-- reached it through the store's own publish_message and the function a caller's transaction calls
-- (publish_in_caller_transaction): a NaN, infinite or too long one failed at make_interval with PostgreSQL's
-- "interval out of range" (SQLSTATE 22008), which the store does not map, and a negative one was answered
-- `dropped` (tests/engine/test_messages.py).
-- Now publish_message refuses all of them before taking any lock, SQLSTATE SSM01 with the client's words, which
-- the store maps to InvalidInput (what="ttl") and publish_in_caller_transaction (unchanged) answers `invalid`,
-- leaving the caller's transaction usable. 0 (or none) still drops a message no wait takes; a thousand years
-- exactly is kept.
CREATE OR REPLACE FUNCTION {{schema}}.publish_message(p_name text, p_key text, p_payload jsonb, p_message_id text,
                                           p_ttl float8, p_all boolean, p_fingerprint text)
RETURNS TABLE (outcome text, deliveries jsonb, expires_at timestamptz, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_prior {{schema}}.messages%ROWTYPE;
    v_delivered jsonb := '[]'::jsonb;
    v_status text;
    v_expires timestamptz;
    v_cmd bigint;
    s record;
BEGIN
    -- A ttl under a microsecond, the least the database keeps, buffered the message until the publish's own
    -- instant: answered buffered, taken by no wait (migration 0078; the client refuses it first).
    IF p_ttl > 0 AND p_ttl < 1e-6 THEN
        RAISE EXCEPTION 'stepstone: ttl % is under a microsecond, the least a message is buffered for; give 0 (or none) to have it dropped when no wait is open', p_ttl
            USING ERRCODE = 'SSM01';
    END IF;
    -- A NaN, infinite or too long ttl failed below with "interval out of range" (22008), unmapped, and a
    -- negative one was answered dropped: the client refuses all of them, and so does the store, with the
    -- client's bounds (0 to core.timestamps.MAX_SECONDS, a thousand years; NaN sorts above every number here)
    -- and words (migration 0079).
    IF p_ttl < 0 OR p_ttl > 31557600000 THEN
        RAISE EXCEPTION 'stepstone: ttl must be a number of seconds from 0 to a thousand years, got %', p_ttl
            USING ERRCODE = 'SSM01';
    END IF;
    -- A message id names one message whatever its name and key: two publishes of one id wait for each
    -- other here, so the second finds the first's row (duplicate or conflict) instead of failing on the
    -- unique index once the first commits (migration 0068).
    IF p_message_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_message_id, 12));
    END IF;
    -- The rows of the instances it will deliver to (every open subscription's with p_all, else the oldest's),
    -- taken before the key's lock, waiting for a busy one as a signal does, in ascending id (the order a group
    -- commit takes them). Taken under the key's lock they could only be taken NOWAIT (an instance's commit
    -- holds its row and may want the key), and one busy instance of many failed the whole publish: with
    -- correlate_all to many busy instances every attempt met one, and the client's retries ran out
    -- (migration 0075). The loop below still takes each row NOWAIT: it holds these already, and only a
    -- subscription opened since (a row not taken here) can still fail the attempt.
    -- (Subscriptions whose wait is still open, as read before any lock: a stale one, left open until a
    -- publish closes it, would make the oldest one's row the wrong one to wait for.)
    PERFORM 1 FROM {{schema}}.instances i
    WHERE i.id IN (SELECT x.instance_id FROM {{schema}}.subscriptions x
                   JOIN {{schema}}.positions p ON p.instance_id = x.instance_id AND p.path = x.position
                                              AND p.visit = x.visit AND p.status = 'WAITING'
                   WHERE x.name = p_name AND x.correlation_key = p_key AND x.status = 'OPEN'
                   ORDER BY x.created_at, x.id LIMIT CASE WHEN p_all THEN NULL ELSE 1 END)
    ORDER BY i.id FOR UPDATE;
    PERFORM {{schema}}.lock_correlation(p_name, p_key);
    IF p_message_id IS NOT NULL THEN
        SELECT * INTO v_prior FROM {{schema}}.messages m WHERE m.message_id = p_message_id;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN v_prior.fingerprint = p_fingerprint THEN 'duplicate' ELSE 'conflict' END,
                                v_prior.deliveries, v_prior.expires_at, v_prior.status;
            RETURN;
        END IF;
    END IF;
    FOR s IN SELECT x.id, x.instance_id, x.position, x.visit, x.step FROM {{schema}}.subscriptions x
             WHERE x.name = p_name AND x.correlation_key = p_key AND x.status = 'OPEN'
             ORDER BY x.created_at, x.id LOOP
        PERFORM 1 FROM {{schema}}.instances i WHERE i.id = s.instance_id FOR UPDATE NOWAIT;
        CONTINUE WHEN NOT {{schema}}.subscription_takes(s.id, v_now);
        v_cmd := {{schema}}.deliver_to_subscription(
            s.instance_id, s.position, s.visit, s.step, p_name,
            jsonb_build_object('payload', p_payload, 'message_id', p_message_id, 'correlation_key', p_key),
            NULL, v_now);
        v_delivered := v_delivered || jsonb_build_object('instance_id', s.instance_id, 'position', s.position,
                                                         'command_id', v_cmd);
        EXIT WHEN NOT p_all;
    END LOOP;
    IF jsonb_array_length(v_delivered) > 0 THEN
        v_status := 'DELIVERED';
    ELSIF COALESCE(p_ttl, 0) > 0 THEN
        IF (SELECT count(*) FROM (SELECT 1 FROM {{schema}}.messages m
                                  WHERE m.name = p_name AND m.correlation_key = p_key AND m.status = 'BUFFERED'
                                    AND m.expires_at > v_now
                                  LIMIT {{schema}}.max_open_signals()) AS kept) >= {{schema}}.max_open_signals() THEN
            RETURN QUERY SELECT 'full'::text, '[]'::jsonb, NULL::timestamptz, 'FULL'::text;
            RETURN;
        END IF;
        v_status := 'BUFFERED';
        v_expires := v_now + make_interval(secs => p_ttl);
    ELSE
        v_status := 'DROPPED';
    END IF;
    INSERT INTO {{schema}}.messages (message_id, name, correlation_key, payload, fingerprint, status, deliveries,
                                     created_at, expires_at, delivered_at)
    VALUES (p_message_id, p_name, p_key, p_payload, p_fingerprint, v_status, v_delivered, v_now, v_expires,
            CASE WHEN v_status = 'DELIVERED' THEN v_now END);
    RETURN QUERY SELECT lower(v_status), v_delivered, v_expires, v_status;
END $$;

-- A commit that hands a buffered message on and opens a subscription takes its keys in one order.
--
-- A buffered message whose command a commit settles untaken is handed on at the end of commit_decisions, in
-- (name, key) order, under its key's lock (0077); a commit that enters a wait taking messages takes its
-- subscriptions' keys in open_subscriptions, sorted too. One commit doing both (a join cancelling a branch
-- whose message's command was still open, then entering a message wait; it commits alone, as every commit
-- that subscribes) took the two batches one after the other, not in one order: one subscribing k2 and handing
-- k1 on, and one subscribing k1 and handing k2 on, each held its first key while it waited for the other's
-- (tests/engine/test_buffered_messages.py: DeadlockDetectedError). Now open_subscriptions takes both sets of
-- keys first, in one (name, key) order (the order of the hand-on and of a group's hand-ons); the hand-on at
-- the end takes them again, held already. The commands are those the commit settled before the section
-- runs, which is every one it settles (the positions, the claimed command and the other commands come first).
-- Expand only: publish_message and open_subscriptions replaced with the same signatures.
CREATE OR REPLACE FUNCTION {{schema}}.open_subscriptions(p_commit jsonb, p_items jsonb, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    v_pos text := p_commit->>'position';
    v_step text := p_commit->'move'->>'step';
    v_visit integer;
    v_key text;
    v_names text[];
    v_msg {{schema}}.messages%ROWTYPE;
    v_cmd bigint;
    x jsonb;
    k record;
BEGIN
    -- Every correlation key the commit takes, in one (name, key) order, before any: its subscriptions' and
    -- those of the buffered messages it settled untaken before this section (the join's losers, its own
    -- command, the other commands: stepstone.returned_messages), which commit_decisions hands on at its end
    -- (version 77) under those keys again. Taken there, after these, the two sorted batches crossed: a commit
    -- subscribing k2 and handing k1 on held k2 while it waited for k1, and one subscribing k1 and handing
    -- k2 on held k1 while it waited for k2 (migration 0079).
    FOR k IN SELECT nm AS name, it->>'key' AS key
             FROM jsonb_array_elements(p_items) AS it, jsonb_array_elements_text(it->'names') AS nm
             UNION
             SELECT c.name, c.payload->>'correlation_key' FROM {{schema}}.commands c
             WHERE c.id = ANY (string_to_array(NULLIF(current_setting('stepstone.returned_messages', true), ''),
                                               ',')::bigint[])
             ORDER BY 1, 2 LOOP
        PERFORM {{schema}}.lock_correlation(k.name, k.key);
    END LOOP;
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        v_visit := (x->>'visit')::integer;
        v_key := x->>'key';
        v_names := ARRAY(SELECT n FROM jsonb_array_elements_text(x->'names') AS n ORDER BY n);
        PERFORM {{schema}}.lock_correlation(n, v_key) FROM unnest(v_names) AS n ORDER BY n;  -- (held already)
        UPDATE {{schema}}.subscriptions s SET status = 'CLOSED', closed_at = p_now
        WHERE s.instance_id = v_id AND s.position = v_pos AND s.status = 'OPEN' AND s.visit < v_visit;
        INSERT INTO {{schema}}.subscriptions (instance_id, position, visit, step, name, correlation_key, status,
                                              created_at)
        SELECT v_id, v_pos, v_visit, v_step, n, v_key, 'OPEN', p_now FROM unnest(v_names) AS n ORDER BY n;
        SELECT * INTO v_msg FROM {{schema}}.messages m
        WHERE m.status = 'BUFFERED' AND m.name = ANY (v_names) AND m.correlation_key = v_key AND m.expires_at > p_now
        ORDER BY m.id LIMIT 1 FOR UPDATE;
        IF FOUND THEN
            v_cmd := {{schema}}.deliver_to_subscription(
                v_id, v_pos, v_visit, v_step, v_msg.name,
                jsonb_build_object('payload', v_msg.payload, 'message_id', v_msg.message_id,
                                   'correlation_key', v_key, 'buffered', true), v_msg.id, p_now);
            UPDATE {{schema}}.messages m SET status = 'DELIVERED', delivered_at = p_now,
                deliveries = jsonb_build_array(jsonb_build_object('instance_id', v_id, 'position', v_pos,
                                                                  'command_id', v_cmd))
            WHERE m.id = v_msg.id;
        END IF;
    END LOOP;
END $$;
