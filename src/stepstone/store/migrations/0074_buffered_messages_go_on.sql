-- A buffered message taken by a wait that something else then left was lost.
--
-- The commit entering a wait takes the oldest buffered message of its name and key (open_subscriptions,
-- migration 0007) as a MESSAGE command of the wait's position, marked `buffered`, behind whatever is queued
-- there. When a signal queued before it won the wait (or the wait's step deadline passed first), the
-- command was parked and, at the instance's end, rejected (INSTANCE_ENDED); when the instance ended before
-- the command was applied, rejected at once. Either way the message, buffered for exactly the next wait of
-- its name and key (another instance's, or this one's later wait), never reached it. The worker now settles
-- such a command STALE (WAIT_LEFT, or STEP_DEADLINE_PASSED) with a MESSAGE_RETURNED history entry instead of
-- parking it, and the trigger of a command leaving its queue (migration 0072) hands the message on whenever such a
-- command is settled untaken (return_buffered_message below).
-- A message a wait took from the buffer (its MESSAGE command's payload says `buffered`) whose command is
-- settled without being taken: STALE (it found its wait already left: a signal queued before it won the
-- wait, or the wait's step deadline passed first), REJECTED (the instance ended, or was cancelled, before
-- the command was applied), SUPERSEDED, or PARKED (a worker of an earlier release). It was lost there: it
-- was buffered for the next wait of its name and key, and none got it. It goes on now, in the transaction
-- that settles the command: under its key's lock (after the instance's row, positions and commands, the
-- lock order), to the oldest open subscription of that name and key whose wait is still open (as
-- publish_message delivers, its instance's row taken NOWAIT; a busy one is passed over for the next, so
-- the commit settling the command never waits on another instance), recorded as a MESSAGE command again
-- marked `buffered` (so it goes on again if that wait is left before it); else back to the buffer until
-- its expires_at; past that, EXPIRED. The message row is the one the subscription taking it recorded
-- (subscriptions.message). A command that dies (DEAD, a poison command) keeps its message: it is shown
-- dead-lettered, not handed on.
-- One function delivers a message to a subscription's wait (deliver_to_subscription): the hand-on below, the
-- buffer's delivery on entering a wait (open_subscriptions, replaced with the same signature) and, since
-- migration 0075, publish_message.
-- A message delivered to one open subscription's wait (publish_message, open_subscriptions taking one from
-- the buffer, return_buffered_message handing one on): a MESSAGE command of its position, and the
-- subscription CORRELATED, with the message row when the caller has it. The caller holds the instance's
-- row and the key's lock. Returns the command's id.
CREATE FUNCTION {{schema}}.deliver_to_subscription(p_instance uuid, p_position text, p_visit integer, p_step text,
                                                   p_name text, p_body jsonb, p_message bigint, p_now timestamptz)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_cmd bigint;
BEGIN
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     available_at, created_at)
    VALUES (p_instance, p_position, nextval('{{schema}}.command_seq'), 'MESSAGE', 'PENDING', p_step, p_visit,
            p_name, p_body, p_now, p_now)
    RETURNING id INTO v_cmd;
    UPDATE {{schema}}.subscriptions x SET status = 'CORRELATED', message = COALESCE(p_message, x.message),
        closed_at = p_now
    WHERE x.instance_id = p_instance AND x.position = p_position AND x.visit = p_visit AND x.status = 'OPEN';
    RETURN v_cmd;
END $$;

CREATE FUNCTION {{schema}}.return_buffered_message(p_old {{schema}}.commands) RETURNS void
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
        PERFORM 1 FROM {{schema}}.subscriptions x WHERE x.id = s.id AND x.status = 'OPEN' FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p JOIN {{schema}}.instances i ON i.id = p.instance_id
                       WHERE p.instance_id = s.instance_id AND p.path = s.position AND p.visit = s.visit
                         AND p.status = 'WAITING' AND i.status NOT IN ('COMPLETED', 'CANCELLED')) THEN
            UPDATE {{schema}}.subscriptions x SET status = 'CLOSED', closed_at = v_now WHERE x.id = s.id;
            CONTINUE;
        END IF;
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

-- The trigger of a command leaving its queue (migration 0072) hands the message on.
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
    IF OLD.kind = 'MESSAGE' AND NEW.state IN ('STALE', 'REJECTED', 'SUPERSEDED', 'PARKED')
       AND OLD.payload ? 'buffered' THEN
        PERFORM {{schema}}.return_buffered_message(OLD);
    END IF;
    RETURN NULL;
END $$;

-- The buffer's delivery on entering a wait, through the same function (its body as before otherwise).
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
BEGIN
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        v_visit := (x->>'visit')::integer;
        v_key := x->>'key';
        v_names := ARRAY(SELECT n FROM jsonb_array_elements_text(x->'names') AS n ORDER BY n);
        PERFORM {{schema}}.lock_correlation(n, v_key) FROM unnest(v_names) AS n ORDER BY n;
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
