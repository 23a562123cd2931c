-- A message handed on (migration 0074) passed over an open wait whose instance was busy, and stayed buffered
-- while that wait waited.
--
-- return_buffered_message hands a buffered message that a wait took and never applied to the oldest open
-- wait of its name and key, each wait's instance row taken NOWAIT so that the commit handing it on never
-- waits on another instance (that instance's commit may hold its row and want the key's lock the hand-on
-- holds). A busy one (its row held by its own commit, a signal, a publish, a task operation) was passed over
-- for the next open wait, else the message went back to the buffer. But a wait already open does not look in
-- the buffer again: only the commit entering a wait does. When the busy transaction left that wait open (a
-- signal parked, another branch's commit, a publish to another of its waits) the wait went on waiting with
-- its message buffered beside it, until the message expired (tests/engine/test_buffered_messages.py: the
-- second instance's row held in another connection while the first's commit hands the message on; the
-- message was BUFFERED with the second's wait open).
--
-- Now a busy instance's open wait is given the message without the instance's row. What serializes with it
-- instead is the subscription rows of that wait, taken NOWAIT (subscription_takes_unlocked): whatever closes
-- a subscription or delivers to its wait takes them (a publish, under its own key's lock; the instance's
-- commit entering its next wait or cancelling it), so one of them held means the wait is being closed or
-- given another message, and it is passed over as before. Its wait is read as last committed: when the busy
-- transaction is leaving it meanwhile (a signal applied, its timeout fired), the message's command, marked
-- `buffered` as every handed-on one is, finds the wait left and goes on again (STALE, MESSAGE_RETURNED);
-- when it is ending the instance, the command is rejected at its claim (INSTANCE_ENDED) and goes on. The
-- command is also marked `instance_busy`: recording it (command_recorded) neither moves the position's
-- pending timeout behind it nor waits off the ready walk, since those timer rows may be the busy
-- transaction's, which may want the key. So such a message does not hold that wait's timeout back: a timeout
-- that fires first leaves the wait, and the message goes on to the next.
-- Nothing here waits for a lock; a transaction closing the wait's subscriptions waits for the hand-on's
-- commit instead (the hand-on holds them, never the other way round).
--
-- And a commit hands on the messages it returns after all its items, in key order. The trigger of a command
-- leaving its queue handed the message on as the command was settled, taking its key's lock there. In a
-- group commit (commit_decisions: the items in ascending instance id, each taking its instance's row) an
-- item took its key and held it while the group went on to take its later items' rows: two groups
-- [A (key k2), B (k1)] and [C (k1), D (k2)] closed a cycle on the keys, and so did one group with a
-- publisher of k2 holding B's row (a publish takes the rows first, then the key). PostgreSQL aborted one
-- after deadlock_timeout: a group was committed again one by one, a publisher's call failed
-- (tests/engine/test_buffered_messages.py: "group commit of 2 failed (DeadlockDetectedError)"). Now
-- command_left_queue, inside commit_decisions, notes the command (a transaction-local setting), and
-- commit_decisions hands the noted messages on after its last item (hand_on_returned_messages), in
-- ascending (name, key) order: the keys come after every instance row, as the lock order has them. Elsewhere
-- (a cancel, a purge, a migration of an instance) the hand-on stays where the command is settled.
--
-- And a message whose command an operator's cancel settles goes on too. cancel_tree settles an instance's
-- open commands CANCELLED (settle_open_commands), a buffered message's command among them, and
-- command_left_queue handed on only STALE, REJECTED, SUPERSEDED and PARKED ones: the message stayed DELIVERED
-- to the cancelled instance, and the next wait of its key, open or to come, never got it
-- (tests/engine/test_buffered_messages.py: the open wait stayed WAITING). Now CANCELLED counts as settled
-- untaken, and cancel_tree, outermost, hands the messages on at its end, after its children's rows, as a
-- commit does (a cancel inside a commit, or a child's inside its parent's, leaves them to the outermost).
-- Expand only: new functions; return_buffered_message, command_recorded, command_left_queue, commit_decisions
-- and cancel_tree replaced with the same signatures.
-- Whether the open subscription p_sub takes a message now when its instance's row is held by another
-- transaction (return_buffered_message; the caller holds the key's lock): the open subscriptions of its
-- wait locked NOWAIT, and its wait open as last committed. One of them held means that wait is being closed
-- or given another message (a publish of another of its names, the instance's commit entering its next wait
-- or cancelling it): the answer is false, and nothing waits. The holder may be leaving the wait as it is
-- read (a signal applied, its timeout): the message's command then finds the wait left and goes on again
-- (STALE, MESSAGE_RETURNED). A stale subscription is left open here (it is closed under the instance's row).
CREATE FUNCTION {{schema}}.subscription_takes_unlocked(p_sub bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    s record;
BEGIN
    SELECT x.instance_id, x.position, x.visit INTO s FROM {{schema}}.subscriptions x
    WHERE x.id = p_sub AND x.status = 'OPEN';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    BEGIN
        PERFORM 1 FROM {{schema}}.subscriptions x
        WHERE x.instance_id = s.instance_id AND x.position = s.position AND x.visit = s.visit AND x.status = 'OPEN'
        ORDER BY x.id FOR UPDATE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;
    END;
    RETURN EXISTS (SELECT 1 FROM {{schema}}.subscriptions x
                   JOIN {{schema}}.positions p ON p.instance_id = x.instance_id AND p.path = x.position
                                              AND p.visit = x.visit AND p.status = 'WAITING'
                   JOIN {{schema}}.instances i ON i.id = x.instance_id
                   WHERE x.id = p_sub AND x.status = 'OPEN' AND i.status NOT IN ('COMPLETED', 'CANCELLED'));
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
    IF v_msg.expires_at IS NULL OR v_msg.expires_at <= v_now THEN
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
    UPDATE {{schema}}.messages m SET status = 'BUFFERED', payload = p_old.payload->'payload', deliveries = '[]',
        delivered_at = NULL
    WHERE m.id = v_msg.id;
    RETURN;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.command_recorded() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
BEGIN
    -- A buffered message handed on to a wait whose instance's row another transaction holds (version 77):
    -- that transaction may hold the position's timers and want the key's lock the hand-on holds, so this
    -- one moves nothing and waits for nothing (the claim still checks the head of the queue).
    IF NEW.kind = 'MESSAGE' AND NEW.payload ? 'instance_busy' THEN
        RETURN NEW;
    END IF;
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
    IF EXISTS (SELECT 1 FROM {{schema}}.commands x
               WHERE x.instance_id = NEW.instance_id AND x.position = NEW.position
                 -- the queue index, by instance and position (migration 0028)
                 AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND x.seq < NEW.seq
                 AND x.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION')) THEN
        NEW.available_at := NEW.available_at + interval '1 minute';
    END IF;
    RETURN NEW;
END $$;

-- The buffered messages the commands settled untaken by one commit_decisions call (a commit, or a group of
-- them) left to hand on (command_left_queue): each handed on now, after every item's instance row, in
-- ascending (name, correlation key) order, the order every holder of several keys takes them.
CREATE FUNCTION {{schema}}.hand_on_returned_messages() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[] := string_to_array(NULLIF(current_setting('stepstone.returned_messages', true), ''), ',')::bigint[];
    c {{schema}}.commands%ROWTYPE;
BEGIN
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    PERFORM set_config('stepstone.returned_messages', '', true);
    FOR c IN SELECT * FROM {{schema}}.commands x WHERE x.id = ANY (v_ids)
             ORDER BY x.name, x.payload->>'correlation_key', x.id LOOP
        PERFORM {{schema}}.return_buffered_message(c);
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.commit_decisions(p jsonb)
RETURNS TABLE (idx integer, outcome text, continuation bigint, lease_until timestamptz, committed_at timestamptz,
               state_version bigint, state jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_item jsonb;
    v_i integer := 0;
    r record;
BEGIN
    -- A buffered message an item settles untaken is handed on after every item, in key order (version 77).
    PERFORM set_config('stepstone.hand_on_later', 'on', true);
    FOR v_item IN SELECT jsonb_array_elements(p) LOOP
        FOR r IN SELECT * FROM {{schema}}.commit_decision(v_item) LOOP
            idx := v_i;
            outcome := r.outcome;
            continuation := r.continuation;
            lease_until := r.lease_until;
            committed_at := r.committed_at;
            state_version := r.state_version;
            state := r.state;
            RETURN NEXT;
        END LOOP;
        v_i := v_i + 1;
    END LOOP;
    PERFORM set_config('stepstone.hand_on_later', '', true);
    PERFORM {{schema}}.hand_on_returned_messages();
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
    IF OLD.kind = 'MESSAGE' AND NEW.state IN ('STALE', 'REJECTED', 'SUPERSEDED', 'PARKED', 'CANCELLED')
       AND OLD.payload ? 'buffered' THEN
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

CREATE OR REPLACE FUNCTION {{schema}}.cancel_tree(p_instance uuid, p_reason text, p_actor text, p_notify boolean)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_n integer;
    -- The buffered messages its commands held are handed on at the end, after the children's rows (the
    -- lock order), by the outermost cancel or commit (version 77).
    v_outer boolean := current_setting('stepstone.hand_on_later', true) IS DISTINCT FROM 'on';
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND OR v_inst.status IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT') THEN
        RETURN v_inst.status;
    END IF;
    IF v_outer THEN
        PERFORM set_config('stepstone.hand_on_later', 'on', true);
    END IF;
    PERFORM {{schema}}.close_positions(p_instance, v_now, NULL, false);
    v_n := {{schema}}.settle_open_commands(p_instance, p_reason, p_actor, v_now);
    UPDATE {{schema}}.instances i SET status = 'CANCELLED', wait = NULL, branches = 0, updated_at = v_now,
        ended_at = v_now
    WHERE i.id = p_instance;
    PERFORM {{schema}}.saga_history(p_instance, 'INSTANCE_CANCELLED', v_inst.step, v_inst.visit, NULL, NULL,
                                    p_actor, jsonb_build_object('reason', p_reason, 'commands_cancelled', v_n,
                                                                'status_before', v_inst.status), v_now);
    PERFORM {{schema}}.cancel_children(p_instance, 'parent cancelled', p_actor);
    IF p_notify THEN
        PERFORM {{schema}}.tell_parent(v_inst, 'CANCELLED', p_reason, v_now);
    END IF;
    IF v_outer THEN
        PERFORM set_config('stepstone.hand_on_later', '', true);
        PERFORM {{schema}}.hand_on_returned_messages();
    END IF;
    RETURN 'CANCELLED';
END $$;
