-- A publish to many busy instances ran out of tries.
--
-- publish_message (migration 0007, 0068) takes the correlation key's lock, then each matching instance's row
-- with NOWAIT (an instance's commit holds its row and may want the key: waiting there could close a cycle).
-- One busy instance (its worker committing, a signal, another publish) failed the whole attempt (55P03) and
-- the client began again, about five seconds of tries in all (postgres_tasks._BUSY_ATTEMPTS; the same in
-- publish_in_caller_transaction). With correlate_all=True every attempt must find every matching instance
-- idle at once: the more instances and the busier they are, the likelier one is committing, and the tries
-- ran out (Unavailable, "the matching instance stayed busy"), although each instance was busy only for a
-- moment. Now the publish takes those rows first, after its message id's lock and before the key's, waiting
-- for a busy one as a signal does, in ascending id (a group commit's order); the loop under the key's lock
-- finds them held. Only an instance whose subscription opened between the two can still fail an attempt.
-- publish_message and return_buffered_message (migration 0074) ask one function, subscription_takes, whether a
-- subscription's wait is still open (closing a stale one), where each wrote the same check.
-- Expand only: a new function; publish_message and return_buffered_message replaced with the same signatures.
-- Whether the open subscription p_sub takes a message now (publish_message, return_buffered_message; the
-- caller holds its instance's row and its key's lock): its row locked, its wait still open. A stale one
-- (the wait was left: a signal, its timeout; or the instance ended) is closed here, and the answer is false.
CREATE FUNCTION {{schema}}.subscription_takes(p_sub bigint, p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    s record;
BEGIN
    SELECT x.instance_id, x.position, x.visit INTO s FROM {{schema}}.subscriptions x
    WHERE x.id = p_sub AND x.status = 'OPEN' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p JOIN {{schema}}.instances i ON i.id = p.instance_id
                   WHERE p.instance_id = s.instance_id AND p.path = s.position AND p.visit = s.visit
                     AND p.status = 'WAITING' AND i.status NOT IN ('COMPLETED', 'CANCELLED')) THEN
        UPDATE {{schema}}.subscriptions x SET status = 'CLOSED', closed_at = p_now WHERE x.id = p_sub;
        RETURN false;
    END IF;
    RETURN true;
END $$;
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

CREATE OR REPLACE FUNCTION {{schema}}.return_buffered_message(p_old {{schema}}.commands) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_key text := p_old.payload->>'correlation_key';
    v_msg {{schema}}.messages%ROWTYPE;
    v_cmd bigint;
    s record;
BEGIN
    PERFORM {{schema}}.lock_correlation(p_old.name, v_key);
    SELECT m.* INTO v_msg FROM {{schema}}.messages m
    WHERE m.id = (SELECT x.message FROM {{schema}}.subscriptions x
                  WHERE x.instance_id = p_old.instance_id AND x.position = p_old.position AND x.visit = p_old.visit
                    AND x.name = p_old.name AND x.status = 'CORRELATED' AND x.message IS NOT NULL
                  ORDER BY x.id DESC LIMIT 1)
      AND m.status = 'DELIVERED'
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;  -- its row is gone (purged): nothing to hand on
    END IF;
    IF v_msg.expires_at IS NULL OR v_msg.expires_at <= v_now THEN
        UPDATE {{schema}}.messages m SET status = 'EXPIRED' WHERE m.id = v_msg.id;
        RETURN;
    END IF;
    FOR s IN SELECT x.id, x.instance_id, x.position, x.visit, x.step FROM {{schema}}.subscriptions x
             WHERE x.name = p_old.name AND x.correlation_key = v_key AND x.status = 'OPEN'
             ORDER BY x.created_at, x.id LOOP
        BEGIN
            PERFORM 1 FROM {{schema}}.instances i WHERE i.id = s.instance_id FOR UPDATE NOWAIT;
        EXCEPTION WHEN lock_not_available THEN
            CONTINUE;  -- committing: passed over (its commit may be leaving the wait)
        END;
        CONTINUE WHEN NOT {{schema}}.subscription_takes(s.id, v_now);
        v_cmd := {{schema}}.deliver_to_subscription(
            s.instance_id, s.position, s.visit, s.step, p_old.name,
            jsonb_build_object('payload', p_old.payload->'payload', 'message_id', v_msg.message_id,
                               'correlation_key', v_key, 'buffered', true), v_msg.id, v_now);
        UPDATE {{schema}}.messages m SET delivered_at = v_now,
            deliveries = jsonb_build_array(jsonb_build_object('instance_id', s.instance_id, 'position', s.position,
                                                              'command_id', v_cmd))
        WHERE m.id = v_msg.id;
        RETURN;
    END LOOP;
    UPDATE {{schema}}.messages m SET status = 'BUFFERED', payload = p_old.payload->'payload', deliveries = '[]',
        delivered_at = NULL
    WHERE m.id = v_msg.id;
    RETURN;
END $$;
