-- stepstone schema, version 1.
--
-- Lock order (every transaction that touches several of these rows follows it):
--   instance row  ->  its commands (ascending id)  ->  dedup  ->  history  ->  outbox
-- The instance row is the per-instance mutex: a claim takes it with SKIP LOCKED,
-- a commit, signal, cancel or retry with a plain row lock, always before commands.

-- The one clock. Every time-dependent statement reads db_now(); tests move time
-- by setting the offset, which every session of the database sees at once.
CREATE TABLE {{schema}}.clock (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    offset_by interval NOT NULL DEFAULT '0'
);
INSERT INTO {{schema}}.clock DEFAULT VALUES;

CREATE FUNCTION {{schema}}.db_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT now() + (SELECT offset_by FROM {{schema}}.clock) $$;

-- Registered plans, so any node (and the client) can check a pin and its signal names.
CREATE TABLE {{schema}}.definitions (
    scope text NOT NULL,
    definition_id text NOT NULL,
    version integer NOT NULL,
    plan_hash text NOT NULL,
    plan jsonb NOT NULL,
    registered_at timestamptz NOT NULL,
    PRIMARY KEY (scope, definition_id, version)
);

CREATE TABLE {{schema}}.instances (
    id uuid PRIMARY KEY,
    scope text NOT NULL DEFAULT 'default',
    definition_id text NOT NULL,
    version integer NOT NULL,
    plan_hash text NOT NULL,
    status text NOT NULL,
    state jsonb NOT NULL,
    step text,
    visit integer NOT NULL DEFAULT 1,
    wait jsonb,
    error jsonb,
    business_key text,
    parent_id uuid,
    next_seq bigint NOT NULL DEFAULT 2,
    history_seq integer NOT NULL DEFAULT 0,
    -- The lease: who may write this instance now. Kept out of every index so
    -- claims, renewals and commits stay HOT updates.
    lease_token uuid,
    lease_until timestamptz,
    lease_owner text,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    ended_at timestamptz
) WITH (fillfactor = 70);

CREATE UNIQUE INDEX instances_business_key
    ON {{schema}}.instances (scope, definition_id, business_key) WHERE business_key IS NOT NULL;
CREATE INDEX instances_newest ON {{schema}}.instances (created_at DESC, id DESC);
CREATE INDEX instances_status_newest ON {{schema}}.instances (status, created_at DESC, id DESC);

-- The per-instance ordered command log. A command is claimable when it is the
-- head of its instance's queue (ordered by seq, then id; a continuation inherits
-- its predecessor's seq so it runs before anything queued behind it), available
-- (available_at <= db_now()) and PENDING, DEFERRED or CLAIMED under an expired
-- lease. For a CLAIMED command available_at is its lease expiry. A TIMER before
-- its fire time blocks nothing.
CREATE TABLE {{schema}}.commands (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    instance_id uuid NOT NULL,
    seq bigint NOT NULL,
    kind text NOT NULL,
    state text NOT NULL,
    step text,
    visit integer,
    name text,
    payload jsonb,
    dedup_key text,
    attempt integer NOT NULL DEFAULT 1,
    claims integer NOT NULL DEFAULT 0,
    deferrals integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL,
    token uuid,
    claimed_by text,
    last_error text,
    created_at timestamptz NOT NULL,
    settled_at timestamptz
) WITH (fillfactor = 70);

-- Ready work and expired leases are found through separate indexes, so a claim
-- takes back the commands of a dead worker before any queued backlog.
CREATE INDEX commands_ready ON {{schema}}.commands (available_at, id)
    WHERE state IN ('PENDING', 'DEFERRED');
CREATE INDEX commands_leased ON {{schema}}.commands (available_at, id)
    WHERE state = 'CLAIMED';
CREATE INDEX commands_queue ON {{schema}}.commands (instance_id, seq, id)
    WHERE state IN ('PENDING', 'DEFERRED', 'CLAIMED');
CREATE INDEX commands_parked ON {{schema}}.commands (instance_id, seq, id)
    WHERE state IN ('PARKED', 'DEAD');
CREATE INDEX commands_instance ON {{schema}}.commands (instance_id, id);

-- Idempotency keys of starts and dedup keys of signals.
CREATE TABLE {{schema}}.dedup (
    kind text NOT NULL,
    namespace text NOT NULL,
    key text NOT NULL,
    fingerprint text NOT NULL,
    target text NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (kind, namespace, key)
);

-- Append-only, gapless per instance.
CREATE TABLE {{schema}}.history (
    instance_id uuid NOT NULL,
    seq integer NOT NULL,
    at timestamptz NOT NULL,
    kind text NOT NULL,
    step text,
    visit integer,
    command_id bigint,
    actor text,
    data jsonb,
    PRIMARY KEY (instance_id, seq)
);

-- Transactional outbox: staged in the step's commit, published later.
CREATE TABLE {{schema}}.outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL UNIQUE,
    instance_id uuid NOT NULL,
    type text NOT NULL,
    key text,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    published_at timestamptz
);
CREATE INDEX outbox_pending ON {{schema}}.outbox (id) WHERE published_at IS NULL;

-- Wake-up: a command that becomes PENDING or DEFERRED notifies one channel per
-- schema; the payload is its available time in epoch milliseconds, a hint only.
CREATE FUNCTION {{schema}}.notify_command() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('stepstone_' || TG_TABLE_SCHEMA,
                      (extract(epoch FROM NEW.available_at) * 1000)::bigint::text);
    RETURN NULL;
END $$;

CREATE TRIGGER commands_notify
    AFTER INSERT OR UPDATE OF state, available_at ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED'))
    EXECUTE FUNCTION {{schema}}.notify_command();

-- One fenced commit of a segment: everything a Decision writes, in one round
-- trip, or nothing when the caller's token no longer holds the instance.
-- Returns one row (continuation command id or NULL, its lease expiry, db now)
-- when the commit applied, and no row when it was fenced out.
CREATE FUNCTION {{schema}}.commit_segment(p_instance uuid, p_command bigint, p_token uuid, d jsonb)
RETURNS TABLE (continuation bigint, lease_until timestamptz, committed_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst jsonb := NULLIF(d->'instance', 'null'::jsonb);
    v_settle text := d->'settle'->>'state';
    v_ncmd integer := jsonb_array_length(d->'commands');
    v_nhist integer := jsonb_array_length(d->'history');
    v_cont boolean := (d->>'continuation')::boolean;
    v_ended boolean := (d->>'ended')::boolean;
    v_lease timestamptz := CASE WHEN v_cont THEN v_now + make_interval(secs => (d->>'lease_seconds')::float8) END;
    v_hist integer;
    v_seq bigint;
    v_cur_seq bigint;
    v_next bigint;
BEGIN
    -- 1. The fence, on the instance row (first in the lock order).
    UPDATE {{schema}}.instances i SET
        status = COALESCE(v_inst->>'status', i.status),
        step = CASE WHEN v_inst IS NULL THEN i.step ELSE v_inst->>'step' END,
        visit = COALESCE((v_inst->>'visit')::integer, i.visit),
        wait = CASE WHEN v_inst IS NULL THEN i.wait ELSE NULLIF(v_inst->'wait', 'null'::jsonb) END,
        state = CASE WHEN v_inst ? 'state' THEN v_inst->'state' ELSE i.state END,
        error = CASE WHEN v_inst IS NULL THEN i.error ELSE NULLIF(v_inst->'error', 'null'::jsonb) END,
        history_seq = i.history_seq + v_nhist,
        next_seq = i.next_seq + v_ncmd,
        lease_token = CASE WHEN v_cont THEN p_token END,
        lease_until = v_lease,
        lease_owner = CASE WHEN v_cont THEN i.lease_owner END,
        updated_at = v_now,
        ended_at = CASE WHEN v_ended THEN v_now ELSE i.ended_at END
    WHERE i.id = p_instance AND i.lease_token = p_token
    RETURNING i.history_seq, i.next_seq INTO v_hist, v_seq;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    -- 2. Settle the claimed command, fenced on the same token.
    UPDATE {{schema}}.commands c SET
        state = CASE v_settle WHEN 'RETRY' THEN 'PENDING' ELSE v_settle END,
        available_at = CASE v_settle
            WHEN 'RETRY' THEN v_now + make_interval(secs => (d->'settle'->>'retry_delay')::float8)
            ELSE c.available_at END,
        attempt = CASE v_settle WHEN 'RETRY' THEN c.attempt + 1 ELSE c.attempt END,
        claims = CASE WHEN v_settle IN ('RETRY', 'PARKED') THEN 0 ELSE c.claims END,
        -- The token stays on the settled row: it tells a worker whose commit
        -- outcome was unknown that this claim did settle it.
        last_error = d->'settle'->>'reason',
        settled_at = CASE WHEN v_settle IN ('RETRY', 'PARKED', 'DEAD') THEN NULL ELSE v_now END
    WHERE c.id = p_command AND c.token = p_token AND c.state = 'CLAIMED'
    RETURNING c.seq INTO v_cur_seq;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stepstone: command % is not claimed under the token that holds instance %',
            p_command, p_instance USING ERRCODE = 'P0001';
    END IF;

    -- 3. Other commands of this instance, in ascending id order.
    IF (d->>'close_timers')::boolean THEN
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'WAIT_LEFT'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = p_instance AND x.kind = 'TIMER'
                         AND x.state IN ('PENDING', 'DEFERRED') ORDER BY x.id FOR UPDATE);
    END IF;
    IF v_ended THEN
        UPDATE {{schema}}.commands c SET state = 'REJECTED', token = NULL, settled_at = v_now,
            last_error = 'INSTANCE_ENDED'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = p_instance AND x.id <> p_command
                         AND x.state IN ('PENDING', 'DEFERRED', 'PARKED', 'DEAD')
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF jsonb_array_length(d->'requeue_signals') > 0 THEN
        UPDATE {{schema}}.commands c SET state = 'PENDING', available_at = v_now, claims = 0
        WHERE c.id = (SELECT x.id FROM {{schema}}.commands x
                      WHERE x.instance_id = p_instance AND x.state = 'PARKED' AND x.kind = 'SIGNAL'
                        AND x.name IN (SELECT jsonb_array_elements_text(d->'requeue_signals'))
                      ORDER BY x.seq, x.id LIMIT 1);
    END IF;
    IF v_ncmd > 0 THEN
        WITH ins AS (
            INSERT INTO {{schema}}.commands AS c
                (instance_id, seq, kind, state, step, visit, name, payload, attempt, claims,
                 available_at, token, claimed_by, created_at)
            SELECT p_instance,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_cur_seq ELSE v_seq - v_ncmd + x.ord - 1 END,
                   x.c->>'kind',
                   CASE WHEN (x.c->>'continuation')::boolean THEN 'CLAIMED' ELSE 'PENDING' END,
                   x.c->>'step', (x.c->>'visit')::integer, x.c->>'name', NULLIF(x.c->'payload', 'null'::jsonb),
                   1,
                   CASE WHEN (x.c->>'continuation')::boolean THEN 1 ELSE 0 END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_lease
                        ELSE COALESCE((x.c->>'at')::timestamptz,
                                      v_now + make_interval(secs => COALESCE((x.c->>'delay')::float8, 0)))
                   END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN p_token END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN d->>'worker' END,
                   v_now
            FROM jsonb_array_elements(d->'commands') WITH ORDINALITY AS x(c, ord)
            RETURNING c.id, c.state
        )
        SELECT ins.id INTO v_next FROM ins WHERE ins.state = 'CLAIMED';
    END IF;

    -- 4. History, then outbox.
    IF v_nhist > 0 THEN
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data)
        SELECT p_instance, v_hist - v_nhist + x.ord::integer, v_now, x.h->>'kind', x.h->>'step',
               (x.h->>'visit')::integer, p_command, d->>'actor', NULLIF(x.h->'data', 'null'::jsonb)
        FROM jsonb_array_elements(d->'history') WITH ORDINALITY AS x(h, ord);
    END IF;
    IF jsonb_array_length(d->'events') > 0 THEN
        INSERT INTO {{schema}}.outbox (event_id, instance_id, type, key, payload, created_at)
        SELECT (e->>'event_id')::uuid, p_instance, e->>'type', e->>'key', e->'payload', v_now
        FROM jsonb_array_elements(d->'events') AS e;
    END IF;

    -- Work this segment was blocking (a signal queued behind it) is runnable now.
    IF NOT v_cont AND NOT v_ended AND EXISTS (SELECT 1 FROM {{schema}}.commands x
                              WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED')
                                AND x.available_at <= v_now) THEN
        PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                           WHERE c.oid = '{{schema}}.commands'::regclass),
                          (extract(epoch FROM v_now) * 1000)::bigint::text);
    END IF;

    continuation := v_next;
    lease_until := v_lease;
    committed_at := v_now;
    RETURN NEXT;
END $$;

-- Group commit: several segments' commits in one statement and one transaction
-- (one WAL flush). Items are passed in ascending instance id order (the lock
-- order); each returns its row, or none when fenced out.
CREATE FUNCTION {{schema}}.commit_segments(p jsonb)
RETURNS TABLE (idx integer, continuation bigint, lease_until timestamptz, committed_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_item jsonb;
    v_i integer := 0;
    r record;
BEGIN
    FOR v_item IN SELECT jsonb_array_elements(p) LOOP
        FOR r IN SELECT * FROM {{schema}}.commit_segment(
                (v_item->>'instance')::uuid, (v_item->>'command')::bigint, (v_item->>'token')::uuid,
                v_item->'decision') LOOP
            idx := v_i;
            continuation := r.continuation;
            lease_until := r.lease_until;
            committed_at := r.committed_at;
            RETURN NEXT;
        END LOOP;
        v_i := v_i + 1;
    END LOOP;
END $$;

-- Start an instance: idempotency key, instance row, START command and the
-- baseline history entry in one statement. Returns the new id, or NULL when the
-- key was already used (the caller then reads the dedup row).
CREATE FUNCTION {{schema}}.start_instance(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text,
    p_state jsonb, p_step text, p_business_key text, p_key text, p_fingerprint text,
    p_parent uuid, p_actor text)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    IF p_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('START', p_scope || '/' || p_definition, p_key, p_fingerprint, p_id::text, v_now)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step,
                                      visit, business_key, parent_id, next_seq, history_seq,
                                      created_at, updated_at)
    VALUES (p_id, p_scope, p_definition, p_version, p_plan_hash, 'PENDING', p_state, p_step,
            1, p_business_key, p_parent, 2, 1, v_now, v_now);
    INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, dedup_key, available_at, created_at)
    VALUES (p_id, 1, 'START', 'PENDING', p_step, 1, p_key, v_now, v_now);
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_id, 1, v_now, 'INSTANCE_STARTED', p_step, 1, p_actor,
            jsonb_build_object('state', p_state, 'version', p_version, 'plan_hash', p_plan_hash));
    RETURN p_id;
END $$;

-- Record a signal for one instance. Outcomes: not_found, ended, unknown_signal,
-- duplicate (same dedup key and payload: the earlier command), conflict (same key,
-- other payload), recorded.
CREATE FUNCTION {{schema}}.send_signal(
    p_instance uuid, p_name text, p_payload jsonb, p_dedup_key text, p_fingerprint text, p_actor text)
RETURNS TABLE (outcome text, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_seq bigint;
    v_id bigint;
    v_prior record;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint, NULL::text;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope = v_inst.scope AND d.definition_id = v_inst.definition_id
                     AND d.version = v_inst.version AND d.plan->'signals' ? p_name) THEN
        RETURN QUERY SELECT 'unknown_signal', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    IF p_dedup_key IS NOT NULL THEN
        SELECT x.fingerprint, x.target INTO v_prior FROM {{schema}}.dedup x
        WHERE x.kind = 'SIGNAL' AND x.namespace = p_instance::text AND x.key = p_dedup_key;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN v_prior.fingerprint = p_fingerprint THEN 'duplicate' ELSE 'conflict' END,
                                v_prior.target::bigint, v_inst.status;
            RETURN;
        END IF;
    END IF;
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
        RETURN QUERY SELECT 'ended', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    UPDATE {{schema}}.instances i SET next_seq = i.next_seq + 1 WHERE i.id = p_instance
    RETURNING i.next_seq - 1 INTO v_seq;
    INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, name, payload, dedup_key, available_at, created_at)
    VALUES (p_instance, v_seq, 'SIGNAL', 'PENDING', p_name, p_payload, p_dedup_key, v_now, v_now)
    RETURNING id INTO v_id;
    IF p_dedup_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('SIGNAL', p_instance::text, p_dedup_key, p_fingerprint, v_id::text, v_now);
    END IF;
    RETURN QUERY SELECT 'recorded', v_id, v_inst.status;
END $$;

-- Cancel: settle every open command and end the instance. Idempotent: an ended
-- instance is left as it is and its status returned. A worker still running a
-- handler for it loses its lease and its commit is refused.
CREATE FUNCTION {{schema}}.cancel_instance(p_instance uuid, p_reason text, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_n integer;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
        RETURN QUERY SELECT 'unchanged', v_inst.status;
        RETURN;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = v_now,
        last_error = 'INSTANCE_CANCELLED: ' || c.kind
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.instances i SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, wait = NULL, history_seq = i.history_seq + 1, updated_at = v_now, ended_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_CANCELLED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('reason', p_reason, 'commands_cancelled', v_n));
    RETURN QUERY SELECT 'cancelled', 'CANCELLED'::text;
END $$;

-- Retry a FAILED instance: dead commands are superseded and a RETRY command runs
-- the failed step again from its first attempt.
CREATE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    IF v_inst.status <> 'FAILED' THEN
        RETURN QUERY SELECT 'not_failed', v_inst.status;
        RETURN;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind <> 'SIGNAL'
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.commands c SET state = 'PENDING', claims = 0, available_at = v_now, token = NULL
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind = 'SIGNAL'
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET status = 'RUNNING', error = NULL, next_seq = i.next_seq + 1,
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, available_at, created_at)
    VALUES (p_instance, v_inst.next_seq, 'RETRY', 'PENDING', v_inst.step, v_inst.visit, v_now, v_now);
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_RETRIED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('error', v_inst.error));
    RETURN QUERY SELECT 'retried', 'RUNNING'::text;
END $$;

-- An instance that reaches a status `wait_for` returns on (COMPLETED, FAILED,
-- CANCELLED) notifies its own channel, so a waiting client wakes at once instead
-- of polling. The payload is the instance id. A separate channel from the
-- workers' wake-up, so an ending instance never makes a worker claim; cut to
-- PostgreSQL's 63-byte channel limit (a shared channel between two long schema
-- names only costs a spurious wake-up, as waiters match the id).
CREATE FUNCTION {{schema}}.notify_settled() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('stepstone.settled.' || TG_TABLE_SCHEMA, 63), NEW.id::text);
    RETURN NULL;
END $$;

CREATE TRIGGER instances_notify_settled
    AFTER UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (NEW.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
                       AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.notify_settled();
