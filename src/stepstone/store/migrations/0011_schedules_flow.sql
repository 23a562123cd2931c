-- Schedules and flow control (docs/schedules.md, docs/flow-control.md).
--
-- Lock order: a schedule row (taken with SKIP LOCKED) comes before every instance row, so firing
-- can cancel the previous instance and start the next in one statement. A flow slot row is taken
-- only at commit (deferred constraint triggers), after every instance row the transaction holds;
-- under it, other instances' held START commands are taken with SKIP LOCKED, never waited for.

-- A workflow started on a cron expression or a fixed interval. next_fire_at is the first tick
-- not yet fired; firing locks the row (SKIP LOCKED), starts the ticks' instances and advances it
-- in one statement, so each tick starts once however many workers fire.
CREATE TABLE {{schema}}.schedules (
    name text PRIMARY KEY,
    scope text NOT NULL DEFAULT 'default',
    definition_id text NOT NULL,
    spec jsonb NOT NULL,
    input jsonb,
    paused boolean NOT NULL DEFAULT false,
    next_fire_at timestamptz NOT NULL,
    last_tick timestamptz,
    last_instance uuid,
    fired bigint NOT NULL DEFAULT 0,
    skipped bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE INDEX schedules_due ON {{schema}}.schedules (next_fire_at) WHERE NOT paused;

-- Statuses after which an instance no longer counts as running (for overlap and flow limits).
CREATE FUNCTION {{schema}}.is_ended(p_status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT', 'COMPENSATION_FAILED') $$;

-- Fire one schedule: p_ticks ([{"tick": ..., "id": ...}], oldest first) are the ticks the caller
-- computed from the row's next_fire_at (p_expected); p_next is the tick after them. Outcomes per
-- tick: started, skipped (overlap=skip and the previous instance still runs), duplicate (that
-- tick already started); or one row 'busy' (another worker holds the row) / 'moved' (the row
-- changed since it was read: paused, fired or edited).
CREATE FUNCTION {{schema}}.fire_schedule(
    p_name text, p_expected timestamptz, p_next timestamptz, p_ticks jsonb,
    p_version integer, p_plan_hash text, p_step text, p_state jsonb)
RETURNS TABLE (outcome text, instance_id uuid, tick timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_s {{schema}}.schedules%ROWTYPE;
    v_last uuid;
    v_status text;
    v_fired integer := 0;
    v_skipped integer := 0;
    v_id uuid;
    v_tick timestamptz;
    t record;
BEGIN
    SELECT * INTO v_s FROM {{schema}}.schedules s WHERE s.name = p_name FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'busy'::text, NULL::uuid, NULL::timestamptz;
        RETURN;
    END IF;
    IF v_s.paused OR v_s.next_fire_at <> p_expected THEN
        RETURN QUERY SELECT 'moved'::text, NULL::uuid, NULL::timestamptz;
        RETURN;
    END IF;
    v_last := v_s.last_instance;
    v_tick := v_s.last_tick;
    FOR t IN SELECT x.tick, x.id FROM jsonb_to_recordset(p_ticks) AS x(tick timestamptz, id uuid) ORDER BY x.tick LOOP
        IF v_last IS NOT NULL AND v_s.spec->>'overlap' <> 'allow' THEN
            SELECT i.status INTO v_status FROM {{schema}}.instances i WHERE i.id = v_last;
            IF v_status IS NOT NULL AND NOT {{schema}}.is_ended(v_status) THEN
                IF v_s.spec->>'overlap' = 'skip' THEN
                    v_skipped := v_skipped + 1;
                    v_tick := t.tick;
                    RETURN QUERY SELECT 'skipped'::text, v_last, t.tick;
                    CONTINUE;
                END IF;
                PERFORM {{schema}}.cancel_instance(v_last, 'schedule ' || p_name || ': overlapped by its next tick',
                                                  'schedule:' || p_name);
            END IF;
        END IF;
        v_id := {{schema}}.start_instance(t.id, v_s.scope, v_s.definition_id, p_version, p_plan_hash, p_state, p_step,
                                          NULL, 'schedule:' || p_name || ':' || (extract(epoch FROM t.tick) * 1000000)::bigint::text, 'schedule', NULL,
                                          'schedule:' || p_name);
        v_tick := t.tick;
        IF v_id IS NULL THEN
            RETURN QUERY SELECT 'duplicate'::text, t.id, t.tick;
        ELSE
            v_fired := v_fired + 1;
            v_last := v_id;
            RETURN QUERY SELECT 'started'::text, v_id, t.tick;
        END IF;
    END LOOP;
    UPDATE {{schema}}.schedules s SET next_fire_at = p_next, last_tick = v_tick, last_instance = v_last,
        fired = s.fired + v_fired, skipped = s.skipped + v_skipped, updated_at = {{schema}}.db_now()
    WHERE s.name = p_name;
END $$;

-- Flow control: at most max_running instances of a workflow run at once (per value of key_field
-- when given: 'business_key' or a top-level state field), and starts at least min_interval_seconds
-- apart (per key). An instance past the limit waits as a row: its START command is DEFERRED until a
-- slot frees, then runs in start order.
CREATE TABLE {{schema}}.flow_limits (
    scope text NOT NULL DEFAULT 'default',
    definition_id text NOT NULL,
    key_field text,
    max_running integer CHECK (max_running > 0),
    min_interval_seconds float8 CHECK (min_interval_seconds > 0),
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (scope, definition_id)
);

CREATE TABLE {{schema}}.flow_slots (
    scope text NOT NULL,
    definition_id text NOT NULL,
    key_value text NOT NULL,
    running integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    next_start_at timestamptz,
    PRIMARY KEY (scope, definition_id, key_value)
);

CREATE TABLE {{schema}}.flow_queue (
    instance_id uuid PRIMARY KEY,
    scope text NOT NULL,
    definition_id text NOT NULL,
    key_value text NOT NULL,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    queued_at timestamptz NOT NULL
);
CREATE INDEX flow_queue_order ON {{schema}}.flow_queue (scope, definition_id, key_value, seq);

-- The bucket an instance of a limited workflow counts in; NULL for unlimited workflows.
ALTER TABLE {{schema}}.instances ADD COLUMN flow_key text;

-- Far in the future, finite: a held START is DEFERRED until then, i.e. until a slot admits it.
CREATE FUNCTION {{schema}}.flow_held_until() RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT '9999-01-01 00:00:00+00'::timestamptz $$;

-- Admit held instances of one bucket while it has free slots, oldest first. The caller holds the
-- slot row. Another instance's START is taken with SKIP LOCKED: one being cancelled right now is
-- passed over (its cancel removes it from the queue), never waited for.
CREATE FUNCTION {{schema}}.flow_admit_queued(p_scope text, p_definition text, p_key text, p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_lim {{schema}}.flow_limits%ROWTYPE;
    v_slot {{schema}}.flow_slots%ROWTYPE;
    v_passed uuid[] := '{}';
    v_next uuid;
    v_cmd bigint;
    v_at timestamptz;
    v_admitted integer := 0;
BEGIN
    SELECT * INTO v_lim FROM {{schema}}.flow_limits l WHERE l.scope = p_scope AND l.definition_id = p_definition;
    SELECT * INTO v_slot FROM {{schema}}.flow_slots s
    WHERE s.scope = p_scope AND s.definition_id = p_definition AND s.key_value = p_key;
    LOOP
        EXIT WHEN v_lim.max_running IS NOT NULL AND v_slot.running >= v_lim.max_running;
        SELECT q.instance_id INTO v_next FROM {{schema}}.flow_queue q
        WHERE q.scope = p_scope AND q.definition_id = p_definition AND q.key_value = p_key
          AND q.instance_id <> ALL (v_passed)
        ORDER BY q.seq LIMIT 1 FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        SELECT c.id INTO v_cmd FROM {{schema}}.commands c
        WHERE c.instance_id = v_next AND c.kind = 'START' AND c.state = 'DEFERRED'
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            v_passed := v_passed || v_next;
            CONTINUE;
        END IF;
        v_at := GREATEST(p_now, COALESCE(v_slot.next_start_at, p_now));
        UPDATE {{schema}}.commands c SET state = 'PENDING', available_at = v_at, last_error = NULL WHERE c.id = v_cmd;
        DELETE FROM {{schema}}.flow_queue q WHERE q.instance_id = v_next;
        v_slot.running := v_slot.running + 1;
        IF v_lim.min_interval_seconds IS NOT NULL THEN
            v_slot.next_start_at := v_at + make_interval(secs => v_lim.min_interval_seconds);
        END IF;
        v_admitted := v_admitted + 1;
    END LOOP;
    UPDATE {{schema}}.flow_slots s SET running = v_slot.running, next_start_at = v_slot.next_start_at
    WHERE s.scope = p_scope AND s.definition_id = p_definition AND s.key_value = p_key;
    RETURN v_admitted;
END $$;

-- At commit of a transaction that inserted a START: admit the instance into its bucket, or hold it.
CREATE FUNCTION {{schema}}.flow_on_start() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_inst record;
    v_lim {{schema}}.flow_limits%ROWTYPE;
    v_key text;
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    SELECT i.scope, i.definition_id, i.business_key, i.state INTO v_inst
    FROM {{schema}}.instances i WHERE i.id = NEW.instance_id;
    SELECT * INTO v_lim FROM {{schema}}.flow_limits l
    WHERE l.scope = v_inst.scope AND l.definition_id = v_inst.definition_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_key := CASE WHEN v_lim.key_field IS NULL THEN ''
                  WHEN v_lim.key_field = 'business_key' THEN COALESCE(v_inst.business_key, '')
                  ELSE COALESCE(v_inst.state->>v_lim.key_field, '') END;
    INSERT INTO {{schema}}.flow_slots (scope, definition_id, key_value) VALUES (v_inst.scope, v_inst.definition_id, v_key)
    ON CONFLICT DO NOTHING;
    PERFORM 1 FROM {{schema}}.flow_slots s
    WHERE s.scope = v_inst.scope AND s.definition_id = v_inst.definition_id AND s.key_value = v_key FOR UPDATE;
    UPDATE {{schema}}.instances i SET flow_key = v_key WHERE i.id = NEW.instance_id;
    UPDATE {{schema}}.commands c SET state = 'DEFERRED', available_at = {{schema}}.flow_held_until(),
        last_error = 'FLOW_HELD: waiting for a slot of the concurrency or rate limit'
    WHERE c.id = NEW.id AND c.state = 'PENDING';
    IF FOUND THEN
        INSERT INTO {{schema}}.flow_queue (instance_id, scope, definition_id, key_value, queued_at)
        VALUES (NEW.instance_id, v_inst.scope, v_inst.definition_id, v_key, v_now);
        PERFORM {{schema}}.flow_admit_queued(v_inst.scope, v_inst.definition_id, v_key, v_now);
    END IF;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER commands_flow_start
    AFTER INSERT ON {{schema}}.commands DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.kind = 'START')
    EXECUTE FUNCTION {{schema}}.flow_on_start();

-- At commit of a transaction that ended (or retried) an instance of a limited workflow: free its
-- slot and admit the next held instance (or take the slot back on retry, even past the limit).
CREATE FUNCTION {{schema}}.flow_on_status() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    IF {{schema}}.is_ended(NEW.status) = {{schema}}.is_ended(OLD.status) THEN
        RETURN NULL;
    END IF;
    DELETE FROM {{schema}}.flow_queue q WHERE q.instance_id = NEW.id;
    IF FOUND THEN
        RETURN NULL;  -- ended while still held: it never had a slot
    END IF;
    PERFORM 1 FROM {{schema}}.flow_slots s
    WHERE s.scope = NEW.scope AND s.definition_id = NEW.definition_id AND s.key_value = NEW.flow_key FOR UPDATE;
    UPDATE {{schema}}.flow_slots s
    SET running = GREATEST(s.running + CASE WHEN {{schema}}.is_ended(NEW.status) THEN -1 ELSE 1 END, 0)
    WHERE s.scope = NEW.scope AND s.definition_id = NEW.definition_id AND s.key_value = NEW.flow_key;
    PERFORM {{schema}}.flow_admit_queued(NEW.scope, NEW.definition_id, NEW.flow_key, v_now);
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER instances_flow_status
    AFTER UPDATE OF status ON {{schema}}.instances DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.flow_key IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.flow_on_status();

-- Durable context (stepstone/context.py): what the caller bound when it started an instance (trace
-- context, correlation id, tenant, acting user, ...) is kept on the instance, and what it bound when
-- it sent a signal on that command; a claim hands a handler its command's context, else its
-- instance's. NULL (nothing bound) costs nothing.
ALTER TABLE {{schema}}.instances ADD COLUMN context jsonb;
ALTER TABLE {{schema}}.commands ADD COLUMN context jsonb;

-- A child instance inherits its parent's context (so its steps run in the parent's trace and values).
CREATE FUNCTION {{schema}}.inherit_context() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT p.context INTO NEW.context FROM {{schema}}.instances p WHERE p.id = NEW.parent_id;
    RETURN NEW;
END $$;

CREATE TRIGGER instances_inherit_context
    BEFORE INSERT ON {{schema}}.instances
    FOR EACH ROW WHEN (NEW.parent_id IS NOT NULL AND NEW.context IS NULL)
    EXECUTE FUNCTION {{schema}}.inherit_context();

-- An outbox event carries the trace of the instance it belongs to into the broker (traceparent header),
-- unless it was staged with one.
CREATE FUNCTION {{schema}}.outbox_trace_context() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT i.context->'trace' INTO NEW.trace_context FROM {{schema}}.instances i
    WHERE i.id = NEW.instance_id AND i.context IS NOT NULL;
    RETURN NEW;
END $$;

CREATE TRIGGER outbox_trace_context
    BEFORE INSERT ON {{schema}}.outbox
    FOR EACH ROW WHEN (NEW.trace_context IS NULL)
    EXECUTE FUNCTION {{schema}}.outbox_trace_context();

-- start_instance, keeping the caller's context on the new instance (NULL when the key repeated).
CREATE FUNCTION {{schema}}.start_with_context(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text,
    p_state jsonb, p_step text, p_business_key text, p_key text, p_fingerprint text, p_actor text,
    p_context jsonb)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
BEGIN
    v_id := {{schema}}.start_instance(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state, p_step,
                                      p_business_key, p_key, p_fingerprint, NULL, p_actor);
    IF v_id IS NOT NULL AND p_context IS NOT NULL THEN
        UPDATE {{schema}}.instances i SET context = p_context WHERE i.id = v_id;
    END IF;
    RETURN v_id;
END $$;

-- signal_position, keeping the caller's context on the signal's command.
CREATE FUNCTION {{schema}}.signal_with_context(
    p_instance uuid, p_position text, p_name text, p_payload jsonb, p_dedup_key text, p_fingerprint text,
    p_actor text, p_context jsonb)
RETURNS TABLE (outcome text, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    SELECT * INTO r FROM {{schema}}.signal_position(p_instance, p_position, p_name, p_payload, p_dedup_key,
                                                     p_fingerprint, p_actor) AS s;
    IF r.outcome = 'recorded' AND p_context IS NOT NULL THEN
        UPDATE {{schema}}.commands c SET context = p_context WHERE c.id = r.command_id;
    END IF;
    RETURN QUERY SELECT r.outcome, r.command_id, r.status;
END $$;

-- Start inside the caller's own transaction (Client.start(connection=...)): one statement whatever the
-- driver, and a business key already in use is an outcome, not an error that would abort the
-- caller's transaction (the EXCEPTION block is a subtransaction: only this start is undone).
-- Outcomes: started, repeated (the idempotency key already started target; compare fingerprint),
-- business_key (target holds the key).
CREATE FUNCTION {{schema}}.start_in_caller_transaction(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text,
    p_state jsonb, p_step text, p_business_key text, p_key text, p_fingerprint text, p_actor text,
    p_context jsonb)
RETURNS TABLE (outcome text, target text, fingerprint text)
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
BEGIN
    BEGIN
        v_id := {{schema}}.start_with_context(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state, p_step,
                                              p_business_key, p_key, p_fingerprint, p_actor, p_context);
    EXCEPTION WHEN unique_violation THEN
        RETURN QUERY SELECT 'business_key'::text, i.id::text, NULL::text FROM {{schema}}.instances i
                     WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
        RETURN;
    END;
    IF v_id IS NULL THEN
        RETURN QUERY SELECT 'repeated'::text, x.target, x.fingerprint FROM {{schema}}.dedup x
                     WHERE x.kind = 'START' AND x.namespace = p_scope || '/' || p_definition AND x.key = p_key;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'started'::text, v_id::text, NULL::text;
END $$;
