-- A message published straight to an open wait that the instance left before applying it was parked there
-- for good.
--
-- publish_message delivers a message to the oldest open wait of its name and key as a MESSAGE command of that
-- wait's position (answered `delivered`). When the instance left the wait before applying it (a signal queued
-- before it won the wait, the wait's timeout fired first, its step deadline passed, or the instance was
-- cancelled or ended), the command was settled PARKED (or CANCELLED, REJECTED), and the message stayed with an
-- instance that never acted on it: a parked message is applied by no later wait (only a parked signal is), and
-- the next wait of its key, another instance's or the same instance's, never got it
-- (tests/engine/test_straight_hand_on.py: test_the_next_open_wait_of_the_key_takes_it printed
-- "assert 'await_m' == 'after'", the second wait of the key still waiting; test_with_no_open_wait_it_is_buffered_for_the_next
-- printed "assert ('DELIVERED', [...]) == ('BUFFERED', [])"). A message the wait had taken from the buffer
-- went on in that case (migrations 0074-0077); where the message came from, the publisher can neither know nor
-- choose.
-- Now one rule for both: a message delivered to one wait goes on if that wait is left before it. publish_message
-- marks its command `goes_on` and records the message row on the subscription (its id taken before the row is
-- written), as a wait taking a message from the buffer does; the worker settles the command STALE
-- (MESSAGE_RETURNED), and the trigger of a command leaving its queue hands the message on
-- (return_buffered_message) to the oldest open wait of its name and key, else back to the buffer until the
-- expires_at its publish gave it. A message published with no ttl has no expires_at: it goes to an open wait
-- of its key if there is one, else it is DROPPED, as a publish that finds no open wait drops it (until now
-- return_buffered_message expired such a message at once; no buffered message has none). A message published
-- with correlate_all went to every wait open then: a copy whose wait is left is parked, as before.
-- A command recorded by an earlier release's publish (no `goes_on`) is parked as before; one recorded now and
-- settled PARKED by an earlier release's worker is handed on (the trigger hands on a PARKED one too).
-- Expand only: publish_message, return_buffered_message and command_left_queue replaced with the same signatures.

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
    v_msg bigint;
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
        -- Delivered to one wait, the message goes on if that wait is left before it (`goes_on`, version 87):
        -- its row's id, taken now, is the subscription's message, as a message taken from the buffer is.
        IF NOT p_all THEN
            v_msg := nextval('{{schema}}.messages_id_seq');
        END IF;
        v_cmd := {{schema}}.deliver_to_subscription(
            s.instance_id, s.position, s.visit, s.step, p_name,
            jsonb_build_object('payload', p_payload, 'message_id', p_message_id, 'correlation_key', p_key)
            || CASE WHEN p_all THEN '{}'::jsonb ELSE '{"goes_on": true}'::jsonb END,
            v_msg, v_now);
        v_delivered := v_delivered || jsonb_build_object('instance_id', s.instance_id, 'position', s.position,
                                                         'command_id', v_cmd);
        EXIT WHEN NOT p_all;
    END LOOP;
    -- Kept until then whether delivered or buffered: one delivered and handed back goes to the buffer until
    -- it (version 87).
    IF COALESCE(p_ttl, 0) > 0 THEN
        v_expires := v_now + make_interval(secs => p_ttl);
    END IF;
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
    ELSE
        v_status := 'DROPPED';
    END IF;
    INSERT INTO {{schema}}.messages (id, message_id, name, correlation_key, payload, fingerprint, status, deliveries,
                                     created_at, expires_at, delivered_at)
    OVERRIDING SYSTEM VALUE
    VALUES (COALESCE(v_msg, nextval('{{schema}}.messages_id_seq')), p_message_id, p_name,
            p_key, p_payload, p_fingerprint, v_status, v_delivered, v_now, v_expires,
            CASE WHEN v_status = 'DELIVERED' THEN v_now END);
    RETURN QUERY SELECT lower(v_status), v_delivered, CASE WHEN v_status = 'BUFFERED' THEN v_expires END, v_status;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.return_buffered_message(p_old {{schema}}.commands) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_key text := p_old.payload->>'correlation_key';
    v_msg {{schema}}.messages%ROWTYPE;
    v_cmd bigint;
    v_busy boolean;
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
    -- Past its expires_at, EXPIRED. One published with no ttl (and none: version 87) has none: it goes to an
    -- open wait of its key, else it is dropped (below), kept for no later wait.
    IF v_msg.expires_at <= v_now THEN
        UPDATE {{schema}}.messages m SET status = 'EXPIRED' WHERE m.id = v_msg.id;
        RETURN;
    END IF;
    FOR s IN SELECT x.id, x.instance_id, x.position, x.visit, x.step FROM {{schema}}.subscriptions x
             WHERE x.name = p_old.name AND x.correlation_key = v_key AND x.status = 'OPEN'
             ORDER BY x.created_at, x.id LOOP
        -- Its instance's row NOWAIT: the commit handing the message on never waits on another instance. A busy
        -- one (its row held: its commit, a signal, a publish) is not passed over: an open wait does not look
        -- in the buffer again. It is given the message without its row (version 77), the command marked
        -- `instance_busy` so that recording it waits for nothing of that instance's.
        v_busy := false;
        BEGIN
            PERFORM 1 FROM {{schema}}.instances i WHERE i.id = s.instance_id FOR UPDATE NOWAIT;
        EXCEPTION WHEN lock_not_available THEN
            v_busy := true;
        END;
        IF v_busy THEN
            CONTINUE WHEN NOT {{schema}}.subscription_takes_unlocked(s.id);
        ELSE
            CONTINUE WHEN NOT {{schema}}.subscription_takes(s.id, v_now);
        END IF;
        v_cmd := {{schema}}.deliver_to_subscription(
            s.instance_id, s.position, s.visit, s.step, p_old.name,
            jsonb_build_object('payload', p_old.payload->'payload', 'message_id', v_msg.message_id,
                               'correlation_key', v_key, 'buffered', true)
            || CASE WHEN v_busy THEN '{"instance_busy": true}'::jsonb ELSE '{}'::jsonb END, v_msg.id, v_now);
        UPDATE {{schema}}.messages m SET delivered_at = v_now,
            deliveries = jsonb_build_array(jsonb_build_object('instance_id', s.instance_id, 'position', s.position,
                                                              'command_id', v_cmd))
        WHERE m.id = v_msg.id;
        RETURN;
    END LOOP;
    UPDATE {{schema}}.messages m SET status = CASE WHEN v_msg.expires_at IS NULL THEN 'DROPPED' ELSE 'BUFFERED' END,
        payload = p_old.payload->'payload', deliveries = '[]', delivered_at = NULL
    WHERE m.id = v_msg.id;
    RETURN;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.command_left_queue() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    UPDATE {{schema}}.commands c SET available_at = v_now
    WHERE c.id = (SELECT x.id FROM {{schema}}.commands x
                  WHERE x.instance_id = NEW.instance_id AND x.position = NEW.position
                    -- the queue index, by instance and position (migration 0028)
                    AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND x.state = 'PENDING'
                    AND x.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION') AND x.available_at > v_now
                  ORDER BY x.seq, x.id LIMIT 1);
    -- CANCELLED: an operator's cancel settles the open commands so (settle_open_commands; version 77).
    -- `goes_on`: a message published straight to the wait (version 87), handed on the same way.
    IF OLD.kind = 'MESSAGE' AND NEW.state IN ('STALE', 'REJECTED', 'SUPERSEDED', 'PARKED', 'CANCELLED')
       AND OLD.payload ?| ARRAY['buffered', 'goes_on'] THEN
        IF current_setting('stepstone.hand_on_later', true) = 'on' THEN
            -- Settled by a commit (commit_decisions): handed on at its end, in key order (version 77).
            PERFORM set_config('stepstone.returned_messages',
                               concat_ws(',', NULLIF(current_setting('stepstone.returned_messages', true), ''),
                                         OLD.id::text), true);
        ELSE
            PERFORM {{schema}}.return_buffered_message(OLD);
        END IF;
    END IF;
    RETURN NULL;
END $$;
