-- Human tasks and correlated messages (issue 11).
--
-- A task is a row opened by the commit that enters a task step (feature section 'tasks', rank 20);
-- statuses OPEN -> COMPLETING (reserved by its completion command, in one transaction with that
-- command) -> COMPLETED, or CANCELLED / EXPIRED. Operations from outside (claim, unclaim, reassign,
-- delegate, resolve, complete) are the task_* functions below: each locks the instance row, then the
-- task row, so they serialize with the instance's commits and never deadlock with them.
--
-- A subscription is a row opened by the commit that enters a wait taking messages (feature section
-- 'subscriptions', rank 25). A message is published by publish_message: delivered to the oldest open
-- subscription (or to all of them), else buffered with a TTL, else dropped; the answer says which.
-- Subscribing and publishing for one (name, correlation key) serialize on one transaction-scoped
-- advisory lock, so a message published while a subscription opens is delivered exactly once.
--
-- Lock order (extends the one of version 2): instance row -> positions -> commands -> child instances
-- -> the correlation key's advisory lock (by ascending name, key) -> subscriptions -> messages -> tasks
-- -> dedup -> history -> outbox. A publisher takes the key's lock before it knows the instance; it
-- then takes the instance row with NOWAIT (a busy instance fails the attempt, 55P03, and the client
-- tries again), so it never waits on an instance while holding a key.
--
-- Held back: a signal or message recorded for a position before its wait's timeout fires, and a task
-- completion, move that position's pending timers behind them in the queue (trigger commands_recorded), so
-- a timeout never beats a signal recorded before it, and a task's due date, reminder and expiry never
-- fire while its completion is pending. A parked signal holds nothing back: it leaves the queue.

CREATE TABLE {{schema}}.tasks (
    id uuid PRIMARY KEY,
    instance_id uuid NOT NULL,
    position text NOT NULL,
    step text NOT NULL,
    visit integer NOT NULL,
    scope text NOT NULL,
    definition_id text NOT NULL,
    status text NOT NULL,
    title text NOT NULL,
    description text NOT NULL DEFAULT '',
    assignee text,
    owner text,
    delegation text,
    candidate_users text[] NOT NULL DEFAULT '{}',
    candidate_groups text[] NOT NULL DEFAULT '{}',
    priority integer NOT NULL DEFAULT 50,
    decisions text[] NOT NULL,
    form jsonb NOT NULL,
    data jsonb NOT NULL,
    state_version bigint NOT NULL,
    require_version_stability boolean NOT NULL DEFAULT false,
    due_at timestamptz,
    follow_up_at timestamptz,
    reminded_at timestamptz,
    escalated_at timestamptz,
    completion jsonb,
    completion_command bigint,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    ended_at timestamptz
) WITH (fillfactor = 80);

-- The inbox: open tasks of an assignee, and unassigned ones offered to a user or a group, in inbox
-- order (priority first, then oldest).
CREATE INDEX tasks_open_assignee ON {{schema}}.tasks (assignee, priority DESC, created_at, id)
    WHERE status IN ('OPEN', 'COMPLETING');
CREATE INDEX tasks_open_groups ON {{schema}}.tasks USING gin (candidate_groups)
    WHERE status IN ('OPEN', 'COMPLETING');
CREATE INDEX tasks_open_users ON {{schema}}.tasks USING gin (candidate_users)
    WHERE status IN ('OPEN', 'COMPLETING');
CREATE INDEX tasks_open_order ON {{schema}}.tasks (priority DESC, created_at, id)
    WHERE status IN ('OPEN', 'COMPLETING');
CREATE INDEX tasks_instance ON {{schema}}.tasks (instance_id, position, visit);

CREATE TABLE {{schema}}.subscriptions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    instance_id uuid NOT NULL,
    position text NOT NULL,
    visit integer NOT NULL,
    step text NOT NULL,
    name text NOT NULL,
    correlation_key text NOT NULL,
    status text NOT NULL,
    message bigint,
    created_at timestamptz NOT NULL,
    closed_at timestamptz
);
CREATE INDEX subscriptions_open ON {{schema}}.subscriptions (name, correlation_key, created_at, id)
    WHERE status = 'OPEN';
CREATE INDEX subscriptions_instance ON {{schema}}.subscriptions (instance_id, position, visit)
    WHERE status = 'OPEN';

CREATE TABLE {{schema}}.messages (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id text,
    name text NOT NULL,
    correlation_key text NOT NULL,
    payload jsonb,
    fingerprint text NOT NULL,
    status text NOT NULL,
    deliveries jsonb NOT NULL DEFAULT '[]',
    created_at timestamptz NOT NULL,
    expires_at timestamptz,
    delivered_at timestamptz
);
CREATE UNIQUE INDEX messages_message_id ON {{schema}}.messages (message_id) WHERE message_id IS NOT NULL;
CREATE INDEX messages_buffered ON {{schema}}.messages (name, correlation_key, id) WHERE status = 'BUFFERED';

-- The mutex of one (message name, correlation key): a transaction-scoped advisory lock.
CREATE FUNCTION {{schema}}.lock_correlation(p_name text, p_key text) RETURNS void
LANGUAGE sql AS $$ SELECT pg_advisory_xact_lock(hashtextextended(p_name || chr(31) || p_key, 11)) $$;

-- One history entry of an instance whose row the caller holds locked.
CREATE FUNCTION {{schema}}.append_history(p_instance uuid, p_position text, p_kind text, p_step text,
                                          p_visit integer, p_actor text, p_data jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
BEGIN
    UPDATE {{schema}}.instances i SET history_seq = i.history_seq + 1, updated_at = p_now
    WHERE i.id = p_instance RETURNING i.history_seq INTO v_seq;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data, position)
    VALUES (p_instance, v_seq, p_now, p_kind, p_step, p_visit, p_actor, p_data, p_position);
END $$;

-- Feature section 'tasks': open, complete, expire, reopen, escalate, remind (core/effects.py).
CREATE FUNCTION {{schema}}.apply_task_changes(p_commit jsonb, p_items jsonb, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    v_pos text := p_commit->>'position';
    x jsonb;
    t jsonb;
BEGIN
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        IF x->>'op' = 'open' THEN
            t := x->'task';
            INSERT INTO {{schema}}.tasks (id, instance_id, position, step, visit, scope, definition_id, status,
                                          title, description, assignee, owner, candidate_users, candidate_groups,
                                          priority, decisions, form, data, state_version,
                                          require_version_stability, due_at, follow_up_at, created_at, updated_at)
            SELECT (t->>'id')::uuid, v_id, v_pos, t->>'step', (t->>'visit')::integer, i.scope, i.definition_id,
                   'OPEN', t->>'title', COALESCE(t->>'description', ''), t->>'assignee', t->>'owner',
                   ARRAY(SELECT jsonb_array_elements_text(t->'candidate_users')),
                   ARRAY(SELECT jsonb_array_elements_text(t->'candidate_groups')),
                   (t->>'priority')::integer, ARRAY(SELECT jsonb_array_elements_text(t->'decisions')),
                   t->'form', t->'data', i.state_version, (t->>'require_version_stability')::boolean,
                   (t->>'due_at')::timestamptz, (t->>'follow_up_at')::timestamptz, p_now, p_now
            FROM {{schema}}.instances i WHERE i.id = v_id
            -- The same visit entered again (a retry of a failed position): a completion whose command
            -- is gone (superseded by the retry) gives the task back.
            ON CONFLICT (id) DO UPDATE SET status = 'OPEN', completion = NULL, completion_command = NULL,
                updated_at = p_now
            WHERE {{schema}}.tasks.status = 'COMPLETING'
              AND NOT EXISTS (SELECT 1 FROM {{schema}}.commands c WHERE c.id = {{schema}}.tasks.completion_command
                                AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED'));
        ELSIF x->>'op' = 'complete' THEN
            UPDATE {{schema}}.tasks k SET status = 'COMPLETED', ended_at = p_now, updated_at = p_now
            WHERE k.id = (x->>'task_id')::uuid AND k.status IN ('OPEN', 'COMPLETING');
        ELSIF x->>'op' = 'expire' THEN
            UPDATE {{schema}}.tasks k SET status = 'EXPIRED', ended_at = p_now, updated_at = p_now
            WHERE k.id = (x->>'task_id')::uuid AND k.status IN ('OPEN', 'COMPLETING');
        ELSIF x->>'op' = 'reopen' THEN
            UPDATE {{schema}}.tasks k SET status = 'OPEN', completion = NULL, completion_command = NULL,
                updated_at = p_now
            WHERE k.id = (x->>'task_id')::uuid AND k.status = 'COMPLETING'
              AND k.completion_command = (p_commit->>'command')::bigint;
        ELSIF x->>'op' = 'escalate' THEN
            UPDATE {{schema}}.tasks k SET
                assignee = x->'data'->>'user',
                candidate_groups = CASE WHEN x->'data'->>'group' IS NULL THEN k.candidate_groups
                                        ELSE ARRAY[x->'data'->>'group'] END,
                delegation = NULL, escalated_at = p_now, updated_at = p_now
            WHERE k.id = (x->>'task_id')::uuid AND k.status = 'OPEN';
        ELSIF x->>'op' = 'remind' THEN
            UPDATE {{schema}}.tasks k SET reminded_at = p_now, updated_at = p_now
            WHERE k.id = (x->>'task_id')::uuid;
        ELSE
            RAISE EXCEPTION 'stepstone: unknown task change %', x->>'op' USING ERRCODE = 'P0001';
        END IF;
    END LOOP;
END $$;
INSERT INTO {{schema}}.effect_sections VALUES ('tasks', 20, 'apply_task_changes');

-- Feature section 'subscriptions': a wait that takes messages subscribes to each name for its
-- correlation key; the oldest buffered message that matches is delivered at once.
CREATE FUNCTION {{schema}}.open_subscriptions(p_commit jsonb, p_items jsonb, p_now timestamptz) RETURNS void
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
            INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                             available_at, created_at)
            VALUES (v_id, v_pos, nextval('{{schema}}.command_seq'), 'MESSAGE', 'PENDING', v_step, v_visit,
                    v_msg.name, jsonb_build_object('payload', v_msg.payload, 'message_id', v_msg.message_id,
                                                   'correlation_key', v_key, 'buffered', true),
                    p_now, p_now)
            RETURNING id INTO v_cmd;
            UPDATE {{schema}}.subscriptions s SET status = 'CORRELATED', message = v_msg.id, closed_at = p_now
            WHERE s.instance_id = v_id AND s.position = v_pos AND s.visit = v_visit AND s.status = 'OPEN';
            UPDATE {{schema}}.messages m SET status = 'DELIVERED', delivered_at = p_now,
                deliveries = jsonb_build_array(jsonb_build_object('instance_id', v_id, 'position', v_pos,
                                                                  'command_id', v_cmd))
            WHERE m.id = v_msg.id;
        END IF;
    END LOOP;
END $$;
INSERT INTO {{schema}}.effect_sections VALUES ('subscriptions', 25, 'open_subscriptions');

-- Publish a message. Outcomes: delivered (deliveries: instance, position, command of each), buffered
-- (until expires_at), dropped (no open subscription, no TTL), full (as many messages of this name and
-- key are buffered as max_open_signals allows: nothing kept, no dedup row), duplicate (the same message_id and
-- content: the earlier answer), conflict (the same message_id, other content). SQLSTATE 55P03 when
-- a matching instance is busy committing: nothing was written, the caller tries again.
CREATE FUNCTION {{schema}}.publish_message(p_name text, p_key text, p_payload jsonb, p_message_id text,
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

-- The open-signal cap: an instance holds at most `stepstone.max_open_signals` (a setting, default
-- 1000) open signals and messages (PENDING, DEFERRED or PARKED). One more is refused with SQLSTATE
-- SC429, which aborts the whole statement: a refused signal leaves no command and no dedup row.
CREATE FUNCTION {{schema}}.max_open_signals() RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT COALESCE(NULLIF(current_setting('stepstone.max_open_signals', true), '')::integer, 1000)
$$;

-- A signal, message or task completion recorded for a position (one trigger, so a signal pays one call):
-- * past the cap it is refused (signals and messages only);
-- * the timers it must not lose to move behind it in the position's queue: a wait's timeout not yet
--   due (a signal or message recorded before the timeout's fire time wins), and every pending timer
--   of a task (its due date, reminder and expiry wait while the completion is pending).
CREATE FUNCTION {{schema}}.command_recorded() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
BEGIN
    IF NEW.kind <> 'TASK_COMPLETION' THEN
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
                     AND x.state IN ('PENDING', 'DEFERRED') AND x.seq < NEW.seq
                     AND (NEW.kind = 'TASK_COMPLETION' OR (x.name = 'timeout' AND x.available_at > NEW.created_at))
                   ORDER BY x.id FOR UPDATE);
    RETURN NEW;
END $$;

CREATE TRIGGER commands_recorded
    BEFORE INSERT ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION') AND NEW.state = 'PENDING')
    EXECUTE FUNCTION {{schema}}.command_recorded();

-- A cancelled position (the instance cancelled, a join's losers) cancels its open tasks and closes
-- its subscriptions.
CREATE FUNCTION {{schema}}.close_position_waits() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    UPDATE {{schema}}.tasks k SET status = 'CANCELLED', ended_at = v_now, updated_at = v_now
    WHERE k.instance_id = NEW.instance_id AND k.position = NEW.path AND k.status IN ('OPEN', 'COMPLETING');
    UPDATE {{schema}}.subscriptions s SET status = 'CLOSED', closed_at = v_now
    WHERE s.instance_id = NEW.instance_id AND s.position = NEW.path AND s.status = 'OPEN';
    RETURN NULL;
END $$;

CREATE TRIGGER positions_close_waits
    AFTER UPDATE OF status ON {{schema}}.positions
    FOR EACH ROW WHEN (NEW.status = 'CANCELLED' AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.close_position_waits();

-- Lock an open task's instance row, then the task row (the lock order). NULL when there is no task.
CREATE FUNCTION {{schema}}.lock_task(p_task uuid) RETURNS {{schema}}.tasks
LANGUAGE plpgsql AS $$
DECLARE
    v_task {{schema}}.tasks%ROWTYPE;
BEGIN
    SELECT * INTO v_task FROM {{schema}}.tasks k WHERE k.id = p_task;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM {{schema}}.instances i WHERE i.id = v_task.instance_id FOR UPDATE;
    SELECT * INTO v_task FROM {{schema}}.tasks k WHERE k.id = p_task FOR UPDATE;
    RETURN v_task;
END $$;

-- Whether an actor may work on a task: its assignee, its owner, or (unassigned) a candidate user or a
-- member of a candidate group; anyone when it names nobody.
CREATE FUNCTION {{schema}}.task_allows(p_task {{schema}}.tasks, p_actor text, p_groups text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT COALESCE(p_actor = p_task.assignee OR p_actor = p_task.owner, false)
        OR (p_task.assignee IS NULL AND (p_actor = ANY (p_task.candidate_users)
                                         OR p_task.candidate_groups && COALESCE(p_groups, '{}')
                                         OR (cardinality(p_task.candidate_users) = 0
                                             AND cardinality(p_task.candidate_groups) = 0)))
$$;

-- A task operation's idempotency key seen before: 'duplicate' (same request), 'conflict' (another), or NULL.
CREATE FUNCTION {{schema}}.task_key_seen(p_kind text, p_task uuid, p_key text, p_fingerprint text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN x.fingerprint = p_fingerprint THEN 'duplicate' ELSE 'conflict' END
    FROM {{schema}}.dedup x WHERE x.kind = p_kind AND x.namespace = p_task::text AND x.key = p_key
$$;

-- Claim, unclaim, reassign, delegate, resolve: one function for the operations that change who holds
-- a task. Outcomes: ok, unchanged, not_found, not_open (status), held (someone else holds it: claim
-- never steals unless p_force, which is recorded), not_permitted, not_delegated, duplicate, conflict.
CREATE FUNCTION {{schema}}.task_assign(p_task uuid, p_op text, p_to text, p_actor text, p_groups text[],
                                       p_force boolean, p_reason text, p_key text, p_fingerprint text)
RETURNS TABLE (outcome text, task jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_task {{schema}}.tasks%ROWTYPE;
    v_seen text;
    v_assignee text;
    v_owner text;
    v_delegation text;
    v_kind text;
BEGIN
    v_task := {{schema}}.lock_task(p_task);
    IF v_task.id IS NULL THEN
        RETURN QUERY SELECT 'not_found', NULL::jsonb;
        RETURN;
    END IF;
    v_seen := {{schema}}.task_key_seen('TASK_OP', p_task, p_key, p_fingerprint);
    IF v_seen IS NOT NULL THEN
        RETURN QUERY SELECT v_seen, to_jsonb(v_task);
        RETURN;
    END IF;
    IF v_task.status <> 'OPEN' THEN
        RETURN QUERY SELECT 'not_open', to_jsonb(v_task);
        RETURN;
    END IF;
    v_assignee := v_task.assignee;
    v_owner := v_task.owner;
    v_delegation := v_task.delegation;
    IF p_op = 'claim' THEN
        IF v_task.assignee = p_actor THEN
            RETURN QUERY SELECT 'unchanged', to_jsonb(v_task);
            RETURN;
        END IF;
        IF v_task.assignee IS NOT NULL AND NOT p_force THEN
            RETURN QUERY SELECT 'held', to_jsonb(v_task);
            RETURN;
        END IF;
        IF NOT p_force AND NOT {{schema}}.task_allows(v_task, p_actor, p_groups) THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        v_assignee := p_actor;
        v_kind := 'TASK_CLAIMED';
    ELSIF p_op = 'unclaim' THEN
        IF v_task.assignee IS NULL THEN
            RETURN QUERY SELECT 'unchanged', to_jsonb(v_task);
            RETURN;
        END IF;
        IF v_task.assignee IS DISTINCT FROM p_actor AND NOT p_force THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        v_assignee := NULL;
        v_kind := 'TASK_UNCLAIMED';
    ELSIF p_op IN ('reassign', 'delegate') THEN
        IF NOT p_force AND p_actor IS DISTINCT FROM v_task.assignee AND p_actor IS DISTINCT FROM v_task.owner THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        IF p_op = 'delegate' THEN
            v_owner := COALESCE(v_task.owner, v_task.assignee, p_actor);
            v_delegation := 'PENDING';
            v_kind := 'TASK_DELEGATED';
        ELSE
            v_kind := 'TASK_REASSIGNED';
        END IF;
        v_assignee := p_to;
    ELSIF p_op = 'resolve' THEN
        IF v_task.delegation IS DISTINCT FROM 'PENDING' THEN
            RETURN QUERY SELECT 'not_delegated', to_jsonb(v_task);
            RETURN;
        END IF;
        IF NOT p_force AND p_actor IS DISTINCT FROM v_task.assignee THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        v_assignee := v_task.owner;
        v_delegation := 'RESOLVED';
        v_kind := 'TASK_RESOLVED';
    ELSE
        RAISE EXCEPTION 'stepstone: unknown task operation %', p_op USING ERRCODE = 'P0001';
    END IF;
    UPDATE {{schema}}.tasks k SET assignee = v_assignee, owner = v_owner, delegation = v_delegation,
        updated_at = v_now
    WHERE k.id = p_task RETURNING * INTO v_task;
    IF p_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('TASK_OP', p_task::text, p_key, p_fingerprint, p_op, v_now);
    END IF;
    PERFORM {{schema}}.append_history(v_task.instance_id, v_task.position, v_kind, v_task.step, v_task.visit,
                                      p_actor, jsonb_strip_nulls(jsonb_build_object(
                                          'task_id', p_task, 'assignee', v_assignee, 'owner', v_owner,
                                          'forced', CASE WHEN p_force THEN true END, 'reason', NULLIF(p_reason, ''))),
                                      v_now);
    RETURN QUERY SELECT 'ok', to_jsonb(v_task);
END $$;

-- Complete a task, first of two transactions: reserve it (OPEN -> COMPLETING) and record its
-- TASK_COMPLETION command; the segment then completes it and moves the position, or refuses the
-- command and reopens it. Outcomes: reserved, duplicate (the same key, decision and payload: the
-- task as it is now), conflict (the same key, other content), not_found, not_open (COMPLETING,
-- COMPLETED, ...: the task carries the winner's completion), unknown_decision, not_permitted, stale
-- (changed: the shown fields that changed since the task opened).
CREATE FUNCTION {{schema}}.task_complete(p_task uuid, p_decision text, p_payload jsonb, p_actor text,
                                         p_groups text[], p_force boolean, p_key text, p_fingerprint text,
                                         p_reviewed bigint)
RETURNS TABLE (outcome text, task jsonb, changed text[])
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_task {{schema}}.tasks%ROWTYPE;
    v_seen text;
    v_state jsonb;
    v_changed text[];
    v_cmd bigint;
BEGIN
    v_task := {{schema}}.lock_task(p_task);
    IF v_task.id IS NULL THEN
        RETURN QUERY SELECT 'not_found', NULL::jsonb, NULL::text[];
        RETURN;
    END IF;
    v_seen := {{schema}}.task_key_seen('TASK_COMPLETE', p_task, p_key, p_fingerprint);
    IF v_seen IS NOT NULL THEN
        RETURN QUERY SELECT v_seen, to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF v_task.status <> 'OPEN' THEN
        RETURN QUERY SELECT 'not_open', to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF NOT p_decision = ANY (v_task.decisions) THEN
        RETURN QUERY SELECT 'unknown_decision', to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF NOT p_force AND NOT {{schema}}.task_allows(v_task, p_actor, p_groups) THEN
        RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF v_task.require_version_stability THEN
        SELECT i.state INTO v_state FROM {{schema}}.instances i WHERE i.id = v_task.instance_id;
        v_changed := ARRAY(SELECT f.key FROM jsonb_each(v_task.data) AS f
                           WHERE {{schema}}.state_at(v_state, f.key) IS DISTINCT FROM f.value ORDER BY f.key);
        IF p_reviewed IS DISTINCT FROM v_task.state_version OR cardinality(v_changed) > 0 THEN
            RETURN QUERY SELECT 'stale', to_jsonb(v_task), v_changed;
            RETURN;
        END IF;
    END IF;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     dedup_key, available_at, created_at)
    VALUES (v_task.instance_id, v_task.position, nextval('{{schema}}.command_seq'), 'TASK_COMPLETION', 'PENDING',
            v_task.step, v_task.visit, p_decision,
            jsonb_build_object('task_id', p_task, 'decision', p_decision, 'payload', p_payload, 'actor', p_actor),
            p_key, v_now, v_now)
    RETURNING id INTO v_cmd;
    UPDATE {{schema}}.tasks k SET status = 'COMPLETING', completion_command = v_cmd, updated_at = v_now,
        completion = jsonb_strip_nulls(jsonb_build_object('decision', p_decision, 'payload', p_payload,
                                                          'actor', p_actor, 'key', p_key, 'command', v_cmd,
                                                          'forced', CASE WHEN p_force THEN true END,
                                                          'at', v_now))
    WHERE k.id = p_task RETURNING * INTO v_task;
    IF p_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('TASK_COMPLETE', p_task::text, p_key, p_fingerprint, v_cmd::text, v_now);
    END IF;
    PERFORM {{schema}}.append_history(v_task.instance_id, v_task.position, 'TASK_COMPLETION_RECORDED', v_task.step,
                                      v_task.visit, p_actor, jsonb_strip_nulls(jsonb_build_object(
                                          'task_id', p_task, 'decision', p_decision, 'command', v_cmd,
                                          'forced', CASE WHEN p_force THEN true END)), v_now);
    RETURN QUERY SELECT 'reserved', to_jsonb(v_task), NULL::text[];
END $$;

-- The value at a dotted path of a state document.
CREATE FUNCTION {{schema}}.state_at(p_state jsonb, p_path text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$ SELECT p_state #> string_to_array(p_path, '.') $$;

-- Every open task of one user goes to another (an absent colleague's), instance by instance in the
-- lock order. A task being completed is skipped and counted. p_dry_run counts and changes nothing.
CREATE FUNCTION {{schema}}.task_reassign_all(p_from text, p_to text, p_actor text, p_reason text,
                                             p_dry_run boolean)
RETURNS TABLE (reassigned integer, skipped integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_done integer := 0;
    v_skipped integer := 0;
    v_task {{schema}}.tasks%ROWTYPE;
    r record;
BEGIN
    FOR r IN SELECT k.id, k.status FROM {{schema}}.tasks k
             WHERE k.assignee = p_from AND k.status IN ('OPEN', 'COMPLETING')
             ORDER BY k.instance_id, k.id LOOP
        IF p_dry_run THEN
            IF r.status = 'OPEN' THEN v_done := v_done + 1; ELSE v_skipped := v_skipped + 1; END IF;
            CONTINUE;
        END IF;
        v_task := {{schema}}.lock_task(r.id);
        IF v_task.status <> 'OPEN' OR v_task.assignee IS DISTINCT FROM p_from THEN
            v_skipped := v_skipped + CASE WHEN v_task.status = 'COMPLETING' THEN 1 ELSE 0 END;
            CONTINUE;
        END IF;
        UPDATE {{schema}}.tasks k SET assignee = p_to, updated_at = v_now WHERE k.id = r.id;
        PERFORM {{schema}}.append_history(v_task.instance_id, v_task.position, 'TASK_REASSIGNED', v_task.step,
                                          v_task.visit, p_actor, jsonb_strip_nulls(jsonb_build_object(
                                              'task_id', r.id, 'assignee', p_to, 'from', p_from, 'bulk', true,
                                              'reason', NULLIF(p_reason, ''))), v_now);
        v_done := v_done + 1;
    END LOOP;
    RETURN QUERY SELECT v_done, v_skipped;
END $$;

-- Signal the instance with a business key, starting it first when none has the key, atomically: of
-- two concurrent calls one starts it and both signal it. Outcomes are signal_position's.
CREATE FUNCTION {{schema}}.start_or_signal(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text, p_state jsonb,
    p_step text, p_business_key text, p_start_fingerprint text, p_actor text, p_signal text, p_payload jsonb,
    p_dedup_key text, p_signal_fingerprint text)
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
            PERFORM {{schema}}.start_instance(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state, p_step,
                                              p_business_key, NULL, p_start_fingerprint, NULL, p_actor);
            v_target := p_id;
            v_started := true;
        EXCEPTION WHEN unique_violation THEN
            SELECT i.id INTO v_target FROM {{schema}}.instances i
            WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
        END;
    END IF;
    SELECT * INTO r FROM {{schema}}.signal_position(v_target, '', p_signal, p_payload, p_dedup_key,
                                                    p_signal_fingerprint, p_actor);
    RETURN QUERY SELECT r.outcome, v_target, v_started, r.command_id, r.status;
END $$;
