-- Two publishes of one message id under different names or keys: the second failed on the unique index.
--
-- publish_message (migration 0007) looks a message id up under the lock of its own (name, correlation key),
-- and only there: two publishes of one id with another name or key took different locks, both found no row,
-- and the second, waiting on the first's row in the unique index messages_message_id, failed with a
-- unique violation once the first committed (asyncpg's UniqueViolationError through Client.publish_message,
-- an HTTP 500 from POST /messages), where a publish after the first's commit is told IdempotencyConflict.
-- Now a publish with a message id takes a transaction-scoped advisory lock on the id first, so publishes of
-- one id serialize and the second finds the first's row: duplicate with the same content, conflict with
-- another. Lock order: the message id's lock comes right before the correlation key's (a publisher holds no
-- instance row when it takes either; a subscribing commit takes key locks only).
--
-- A buffered message the commit entering its wait takes was counted as a new arrival.
--
-- The open-signal cap (trigger commands_recorded, migration 0007) refuses a signal or message recorded for an
-- instance that holds max_open_signals open ones. open_subscriptions records a MESSAGE command for the
-- buffered message a wait takes, in the commit that enters the wait, through the same trigger: an instance
-- at its cap (parked signals for later waits) failed that commit with SQLSTATE SC429 ("segment crashed"),
-- claim after claim, and never got on. That message arrived when it was published (and counted against its
-- key's buffer then); a wait takes at most one, so it cannot flood the instance. The trigger now leaves such
-- a command (a MESSAGE whose payload says `buffered`, which only open_subscriptions writes) out of the cap.
-- Expand only: publish_message and command_recorded replaced with the same signatures.
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
        PERFORM 1 FROM {{schema}}.subscriptions x WHERE x.id = s.id AND x.status = 'OPEN' FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p JOIN {{schema}}.instances i ON i.id = p.instance_id
                       WHERE p.instance_id = s.instance_id AND p.path = s.position AND p.visit = s.visit
                         AND p.status = 'WAITING' AND i.status NOT IN ('COMPLETED', 'CANCELLED')) THEN
            -- The wait was left (a signal, its timeout): this subscription is stale.
            UPDATE {{schema}}.subscriptions x SET status = 'CLOSED', closed_at = v_now WHERE x.id = s.id;
            CONTINUE;
        END IF;
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                         available_at, created_at)
        VALUES (s.instance_id, s.position, nextval('{{schema}}.command_seq'), 'MESSAGE', 'PENDING', s.step,
                s.visit, p_name, jsonb_build_object('payload', p_payload, 'message_id', p_message_id,
                                                    'correlation_key', p_key),
                v_now, v_now)
        RETURNING id INTO v_cmd;
        UPDATE {{schema}}.subscriptions x SET status = 'CORRELATED', closed_at = v_now
        WHERE x.instance_id = s.instance_id AND x.position = s.position AND x.visit = s.visit AND x.status = 'OPEN';
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

CREATE OR REPLACE FUNCTION {{schema}}.command_recorded() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
BEGIN
    IF NEW.kind <> 'TASK_COMPLETION' AND NOT (NEW.kind = 'MESSAGE' AND NEW.payload ? 'buffered') THEN
        v_cap := {{schema}}.max_open_signals();
        IF (SELECT count(*) FROM (SELECT 1 FROM {{schema}}.commands c
                                  WHERE c.instance_id = NEW.instance_id AND c.kind IN ('SIGNAL', 'MESSAGE')
                                    AND c.state IN ('PENDING', 'DEFERRED', 'PARKED')
                                  LIMIT v_cap) AS open_ones) >= v_cap THEN
            RAISE EXCEPTION 'stepstone: instance % holds % open signals and messages, the most it may',
                NEW.instance_id, v_cap USING ERRCODE = 'SC429', DETAIL = v_cap::text;
        END IF;
    END IF;
    UPDATE {{schema}}.commands c SET seq = nextval('{{schema}}.command_seq')
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = NEW.instance_id AND x.position = NEW.position AND x.kind = 'TIMER'
                     -- the queue index, by instance and position (migration 0028)
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE AND x.seq < NEW.seq
                     AND (NEW.kind = 'TASK_COMPLETION' OR (x.name = 'timeout' AND x.available_at > NEW.created_at))
                   ORDER BY x.id FOR UPDATE);
    RETURN NEW;
END $$;
