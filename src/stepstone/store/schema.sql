-- stepstone schema, version 2: what migrations 0001 and 0002 build, in that order.
--
-- Lock order: see the head of the version 2 section below (instance row -> positions -> commands
-- -> child instances -> dedup -> history -> outbox). Claims take position rows with SKIP LOCKED.

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
    published_at timestamptz,
    -- The relay (migration 0003). xid: the inserting transaction; the relay takes
    -- only rows below the visibility horizon, so what it sees of a key is a
    -- gapless prefix. NULL (rows staged before 0003) reads as long committed.
    xid xid8 DEFAULT pg_current_xact_id(),
    trace_context jsonb,
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    last_error text,
    dead_at timestamptz,
    -- The relay's lease on a row it is publishing (kept out of every index).
    claim_token uuid,
    claimed_until timestamptz,
    claimed_by text
);
CREATE INDEX outbox_pending ON {{schema}}.outbox (id) WHERE published_at IS NULL;
CREATE INDEX outbox_pending_key ON {{schema}}.outbox (key, id) WHERE published_at IS NULL AND key IS NOT NULL;
CREATE INDEX outbox_dead ON {{schema}}.outbox (id) WHERE dead_at IS NOT NULL AND published_at IS NULL;
CREATE INDEX outbox_unsent_instance ON {{schema}}.outbox (instance_id) WHERE published_at IS NULL;

-- One notification per inserting statement (deduplicated per transaction), a hint only.
CREATE FUNCTION {{schema}}.notify_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('stepstone_outbox_' || TG_TABLE_SCHEMA, 63), '');
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON {{schema}}.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.notify_outbox();

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

-- ==== version 2 (migration 0002_positions) ====

-- Positions and typed effects: an instance has a root position and one per live branch, each with
-- its own step, visit, wait and lease. Commands address a position; the queue-head rule is per
-- (instance, position). Expand only: the instance's step, visit and wait stay readable (the root
-- position's, mirrored) and its lease columns are no longer written; next_seq gives way to one
-- sequence. Stop workers of the previous release before applying it.

CREATE TABLE {{schema}}.positions (
    instance_id uuid NOT NULL,
    path text NOT NULL,
    status text NOT NULL,
    step text,
    visit integer NOT NULL DEFAULT 1,
    wait jsonb,
    error jsonb,
    parent_path text,
    parent_visit integer,
    name text,
    item jsonb,
    -- The lease, kept out of every index so claims, renewals and commits stay HOT updates.
    lease_token uuid,
    lease_until timestamptz,
    lease_owner text,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (instance_id, path)
) WITH (fillfactor = 70);

ALTER TABLE {{schema}}.instances ADD COLUMN state_version bigint NOT NULL DEFAULT 0;
ALTER TABLE {{schema}}.instances ADD COLUMN branches integer NOT NULL DEFAULT 0;
ALTER TABLE {{schema}}.instances ADD COLUMN parent_position text;
ALTER TABLE {{schema}}.instances ADD COLUMN parent_visit integer;
ALTER TABLE {{schema}}.instances ADD COLUMN cancel_with_parent boolean NOT NULL DEFAULT true;
CREATE INDEX instances_children ON {{schema}}.instances (parent_id, id) WHERE parent_id IS NOT NULL;

ALTER TABLE {{schema}}.commands ADD COLUMN position text NOT NULL DEFAULT '';
CREATE INDEX commands_position_queue ON {{schema}}.commands (instance_id, position, seq, id)
    WHERE state IN ('PENDING', 'DEFERRED', 'CLAIMED');

ALTER TABLE {{schema}}.history ADD COLUMN position text;

-- Queue order within a position: (seq, id). One sequence for every queue; a continuation inherits
-- its predecessor's seq so it runs before anything queued behind it.
CREATE SEQUENCE {{schema}}.command_seq;
SELECT setval('{{schema}}.command_seq', GREATEST((SELECT max(seq) FROM {{schema}}.commands), 1) + 1, false);

INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, wait, error,
                                  lease_token, lease_until, lease_owner, created_at, updated_at)
SELECT i.id, '', CASE i.status WHEN 'PENDING' THEN 'RUNNING' ELSE i.status END, i.step, i.visit, i.wait, i.error,
       i.lease_token, i.lease_until, i.lease_owner, i.created_at, i.updated_at
FROM {{schema}}.instances i;
UPDATE {{schema}}.instances SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
WHERE lease_token IS NOT NULL;

-- Lock order (every transaction that touches several of these rows follows it):
--   instance row -> its positions (ascending path) -> its commands (ascending id)
--   -> child instances (ascending id, each in this same order) -> dedup -> history -> outbox
-- Claims take position rows with SKIP LOCKED and never wait, so they cannot be part of a deadlock.
-- A child never waits on its parent's rows: it reports to the parent by inserting a command.

-- Open a fork's branches: a position per branch (reset when the fork runs again) and its first STEP
-- command, claimable by any worker. Returns how many positions it opened.
CREATE FUNCTION {{schema}}.open_branches(p_instance uuid, p_parent text, p_open jsonb, p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
BEGIN
    WITH up AS (
        INSERT INTO {{schema}}.positions AS p (instance_id, path, status, step, visit, parent_path, parent_visit,
                                               name, item, created_at, updated_at)
        SELECT p_instance, b->>'path', 'RUNNING', b->>'step', 1, p_parent, (p_open->>'visit')::integer,
               b->>'name', NULLIF(b->'item', 'null'::jsonb), p_now, p_now
        FROM jsonb_array_elements(p_open->'branches') AS b
        ON CONFLICT (instance_id, path) DO UPDATE SET
            status = 'RUNNING', step = EXCLUDED.step, visit = p.visit + 1, wait = NULL, error = NULL,
            parent_visit = EXCLUDED.parent_visit, item = EXCLUDED.item, lease_token = NULL,
            lease_until = NULL, lease_owner = NULL, updated_at = p_now
        RETURNING p.path, p.step, p.visit
    )
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at, created_at)
    SELECT p_instance, up.path, nextval('{{schema}}.command_seq'), 'STEP', 'PENDING', up.step, up.visit, p_now, p_now
    FROM up ORDER BY up.path;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $$;

-- Cancel one instance and everything under it: its open commands, its positions, and the children
-- that are cancelled with their parent. `p_notify` tells the parent (an operator's cancel of a
-- child); a cancel that comes from the parent does not. Returns the instance's status afterwards.
CREATE FUNCTION {{schema}}.cancel_tree(p_instance uuid, p_reason text, p_actor text, p_notify boolean)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_n integer;
    v_child uuid;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
        RETURN v_inst.status;
    END IF;
    UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = v_now
    WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                      WHERE x.instance_id = p_instance AND x.status NOT IN ('COMPLETED', 'CANCELLED')
                                      ORDER BY x.path FOR UPDATE);
    UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = v_now,
        last_error = 'INSTANCE_CANCELLED: ' || c.kind
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.instances i SET status = 'CANCELLED', wait = NULL, branches = 0,
        history_seq = i.history_seq + 1, updated_at = v_now, ended_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_CANCELLED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('reason', p_reason, 'commands_cancelled', v_n));
    FOR v_child IN SELECT i.id FROM {{schema}}.instances i
                   WHERE i.parent_id = p_instance AND i.cancel_with_parent
                     AND i.status NOT IN ('COMPLETED', 'CANCELLED') ORDER BY i.id LOOP
        PERFORM {{schema}}.cancel_tree(v_child, 'parent cancelled', p_actor, false);
    END LOOP;
    IF p_notify AND v_inst.parent_id IS NOT NULL THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, payload,
                                         available_at, created_at)
        VALUES (v_inst.parent_id, COALESCE(v_inst.parent_position, ''), nextval('{{schema}}.command_seq'),
                'CHILD_COMPLETION', 'PENDING', NULL, v_inst.parent_visit,
                jsonb_build_object('child_id', p_instance, 'status', 'CANCELLED',
                                   'error', jsonb_build_object('type', 'Cancelled', 'message', p_reason)),
                v_now, v_now);
    END IF;
    RETURN 'CANCELLED';
END $$;

-- Cancel the live branches under a path prefix (a join's losers): their positions, open commands
-- and children. Returns how many positions it closed.
CREATE FUNCTION {{schema}}.close_branches(p_instance uuid, p_prefix text, p_reason text, p_now timestamptz,
                                          p_actor text)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
    v_len integer := length(p_prefix);
    v_child uuid;
BEGIN
    UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = p_now
    WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                      WHERE x.instance_id = p_instance AND left(x.path, v_len) = p_prefix
                                        AND x.status NOT IN ('COMPLETED', 'CANCELLED')
                                      ORDER BY x.path FOR UPDATE);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = p_now,
        last_error = 'BRANCH_CANCELLED: ' || p_reason
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND left(x.position, v_len) = p_prefix
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    FOR v_child IN SELECT i.id FROM {{schema}}.instances i
                   WHERE i.parent_id = p_instance AND left(i.parent_position, v_len) = p_prefix
                     AND i.cancel_with_parent AND i.status NOT IN ('COMPLETED', 'CANCELLED') ORDER BY i.id LOOP
        PERFORM {{schema}}.cancel_tree(v_child, 'branch cancelled: ' || p_reason, p_actor, false);
    END LOOP;
    RETURN v_n;
END $$;

-- Start the children a step asked for, in that step's commit. The id is derived from the parent
-- position's step visit, so a second insert of the same child does nothing.
CREATE FUNCTION {{schema}}.start_children(p_instance uuid, p_position text, p_visit integer, p_children jsonb,
                                          p_now timestamptz, p_actor text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_scope text;
    c jsonb;
BEGIN
    SELECT i.scope INTO v_scope FROM {{schema}}.instances i WHERE i.id = p_instance;
    FOR c IN SELECT jsonb_array_elements(p_children) ORDER BY 1 LOOP
        INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step, visit,
                                          parent_id, parent_position, parent_visit, cancel_with_parent,
                                          next_seq, history_seq, created_at, updated_at)
        VALUES ((c->>'id')::uuid, v_scope, c->>'definition_id', (c->>'version')::integer, c->>'plan_hash',
                'PENDING', c->'state', c->>'step', 1, p_instance, p_position, p_visit,
                (c->>'cancel_with_parent')::boolean, 2, 1, p_now, p_now)
        ON CONFLICT (id) DO NOTHING;
        IF FOUND THEN
            INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
            VALUES ((c->>'id')::uuid, '', 'RUNNING', c->>'step', 1, p_now, p_now);
            INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                             created_at)
            VALUES ((c->>'id')::uuid, '', 1, 'START', 'PENDING', c->>'step', 1, p_now, p_now);
            INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
            VALUES ((c->>'id')::uuid, 1, p_now, 'INSTANCE_STARTED', c->>'step', 1, p_actor,
                    jsonb_build_object('state', c->'state', 'version', (c->>'version')::integer,
                                       'plan_hash', c->>'plan_hash', 'parent', p_instance,
                                       'parent_position', p_position));
        END IF;
    END LOOP;
END $$;

-- A step's change to the shared state, carried onto a state another position changed since the
-- step read it. `p_changes` are the step's operations (core/patch.py `changes`): each names an
-- object path, the value there when the step read it (`old`, absent when there was none) and what
-- the step made of it (`value`, or remove). When every path still holds what the step read, the
-- operations are applied to the current state and it is returned; NULL when another position
-- changed one of them too (the step then runs again on the current state), so no update is lost.
CREATE FUNCTION {{schema}}.rebase_state(p_current jsonb, p_changes jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_state jsonb := p_current;
    v_path text[];
    c jsonb;
BEGIN
    IF p_changes IS NULL OR jsonb_typeof(p_changes) <> 'array' THEN
        RETURN NULL;
    END IF;
    FOR c IN SELECT jsonb_array_elements(p_changes) LOOP
        v_path := ARRAY(SELECT jsonb_array_elements_text(c->'path'));
        IF cardinality(v_path) = 0
           OR jsonb_typeof(COALESCE(v_state #> v_path[1:cardinality(v_path) - 1], 'null'::jsonb)) <> 'object'
           OR (c ? 'old' AND (v_state #> v_path) IS DISTINCT FROM c->'old')
           OR (NOT c ? 'old' AND (v_state #> v_path) IS NOT NULL) THEN
            RETURN NULL;
        END IF;
        v_state := CASE WHEN c ? 'value' THEN jsonb_set(v_state, v_path, c->'value', true)
                        ELSE v_state #- v_path END;
    END LOOP;
    RETURN v_state;
END $$;

-- One fenced commit of one decision (see store/effects.py for the document; a section the decision
-- does not use is left out of it). Returns one row:
-- outcome 'ok' (with the continuation's id and lease, and the new state version), 'merged' (the
-- same, the change carried onto a state another position changed meanwhile: the merged state
-- comes back), or 'conflict' (both changed the same part; nothing was written, and the current
-- state comes back), and no row when the position's token no longer holds it (fenced).
CREATE FUNCTION {{schema}}.commit_decision(d jsonb)
RETURNS TABLE (outcome text, continuation bigint, lease_until timestamptz, committed_at timestamptz,
               state_version bigint, state jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_id uuid := (d->>'instance')::uuid;
    v_pos text := d->>'position';
    v_token uuid := (d->>'token')::uuid;
    v_cmd bigint := (d->>'command')::bigint;
    v_move jsonb := NULLIF(d->'move', 'null'::jsonb);
    v_has_state boolean := d ? 'state';
    v_settle text := d->'settle'->>'state';
    v_nhist integer := COALESCE(jsonb_array_length(d->'history'), 0);
    v_cont boolean := (d->>'continuation')::boolean;
    v_end text := d->'end'->>'status';
    v_actor text := d->>'actor';
    v_lease timestamptz := CASE WHEN v_cont THEN v_now + make_interval(secs => (d->>'lease_seconds')::float8) END;
    v_version bigint;
    v_branches integer;
    v_hist integer;
    v_pstatus text;
    v_status text;
    v_cur_seq bigint;
    v_next bigint;
    v_state jsonb;
    x jsonb;
BEGIN
    -- 1. The instance row (first in the lock order), and the shared state's version.
    SELECT i.state_version, i.branches, i.history_seq INTO v_version, v_branches, v_hist
    FROM {{schema}}.instances i WHERE i.id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_has_state AND v_version <> (d->>'state_version')::bigint THEN
        -- A writer whose lease is gone learns that first: a zombie never re-runs its step.
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                       WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token) THEN
            RETURN;
        END IF;
        -- Another position changed the shared state since this decision read it: carry this
        -- change onto the current state when the two touch different parts of it.
        v_state := {{schema}}.rebase_state((SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id),
                                           d->'changes');
        IF v_state IS NULL THEN
            RETURN QUERY SELECT 'conflict'::text, NULL::bigint, NULL::timestamptz, v_now, v_version,
                                (SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id);
            RETURN;
        END IF;
    END IF;

    -- 2. The fence: this position's lease, moved to its new place.
    UPDATE {{schema}}.positions p SET
        status = COALESCE(v_move->>'status', p.status),
        step = CASE WHEN v_move IS NULL THEN p.step ELSE v_move->>'step' END,
        visit = COALESCE((v_move->>'visit')::integer, p.visit),
        wait = CASE WHEN v_move IS NULL THEN p.wait ELSE NULLIF(v_move->'wait', 'null'::jsonb) END,
        error = CASE WHEN v_move IS NULL THEN p.error ELSE NULLIF(v_move->'error', 'null'::jsonb) END,
        lease_token = CASE WHEN v_cont THEN v_token END,
        lease_until = v_lease,
        lease_owner = CASE WHEN v_cont THEN p.lease_owner END,
        updated_at = v_now
    WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token
    RETURNING p.status INTO v_pstatus;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_pos <> '' AND v_move IS NOT NULL AND v_pstatus IN ('COMPLETED', 'CANCELLED') THEN
        v_branches := v_branches - 1;
    END IF;

    -- 3. Other positions: a fork's branches opened, a join's losers closed (with their children).
    IF d->'open' IS NOT NULL AND d->'open' <> 'null'::jsonb THEN
        v_branches := v_branches + {{schema}}.open_branches(v_id, v_pos, d->'open', v_now);
    END IF;
    IF jsonb_array_length(d->'close') > 0 THEN
        FOR x IN SELECT jsonb_array_elements(d->'close') LOOP
            v_branches := v_branches - {{schema}}.close_branches(v_id, x->>'prefix', x->>'reason', v_now, v_actor);
        END LOOP;
    END IF;

    -- 4. The instance: shared state, status (the root's alone, or all live positions'), history count.
    -- (IF, not one CASE: a CASE holding a subquery runs as a query on every commit.)
    IF v_end IS NOT NULL THEN
        v_status := v_end;
    ELSIF v_branches = 0 AND v_pos = '' THEN
        v_status := v_pstatus;
    ELSE
        v_status := (SELECT CASE WHEN bool_or(p.status = 'FAILED') THEN 'FAILED'
                                 WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END
                     FROM {{schema}}.positions p
                     WHERE p.instance_id = v_id AND p.status IN ('RUNNING', 'WAITING', 'FAILED'));
    END IF;
    UPDATE {{schema}}.instances i SET
        status = COALESCE(v_status, i.status),
        state = CASE WHEN v_state IS NOT NULL THEN v_state WHEN v_has_state THEN d->'state' ELSE i.state END,
        state_version = i.state_version + CASE WHEN v_has_state THEN 1 ELSE 0 END,
        error = CASE WHEN v_pstatus = 'FAILED' THEN v_move->'error' ELSE i.error END,
        step = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN v_move->>'step' ELSE i.step END,
        visit = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN (v_move->>'visit')::integer ELSE i.visit END,
        wait = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN NULLIF(v_move->'wait', 'null'::jsonb) ELSE i.wait END,
        history_seq = i.history_seq + v_nhist,
        branches = v_branches,
        updated_at = v_now,
        ended_at = CASE WHEN v_end IS NOT NULL THEN v_now ELSE i.ended_at END
    WHERE i.id = v_id
    RETURNING i.state_version INTO v_version;

    -- 5. Settle the claimed command, fenced on the same token.
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
    WHERE c.id = v_cmd AND c.token = v_token AND c.state = 'CLAIMED'
    RETURNING c.seq INTO v_cur_seq;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stepstone: command % is not claimed under the token that holds instance % position %',
            v_cmd, v_id, v_pos USING ERRCODE = 'P0001';
    END IF;

    -- 6. Other commands of this instance, in ascending id order.
    IF (d->>'close_timers')::boolean THEN
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'WAIT_LEFT'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.position = v_pos AND x.kind = 'TIMER'
                         AND x.state IN ('PENDING', 'DEFERRED') ORDER BY x.id FOR UPDATE);
    END IF;
    IF v_end IS NOT NULL THEN
        UPDATE {{schema}}.commands c SET state = 'REJECTED', token = NULL, settled_at = v_now,
            last_error = 'INSTANCE_ENDED'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.id <> v_cmd
                         AND x.state IN ('PENDING', 'DEFERRED', 'PARKED', 'DEAD')
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF jsonb_array_length(d->'requeue') > 0 THEN
        UPDATE {{schema}}.commands c SET state = 'PENDING', available_at = v_now, claims = 0
        WHERE c.id = (SELECT x.id FROM {{schema}}.commands x
                      WHERE x.instance_id = v_id AND x.position = v_pos AND x.state = 'PARKED' AND x.kind = 'SIGNAL'
                        AND x.name IN (SELECT jsonb_array_elements_text(d->'requeue'))
                      ORDER BY x.seq, x.id LIMIT 1);
    END IF;
    IF jsonb_array_length(d->'commands') > 0 THEN
        WITH ins AS (
            INSERT INTO {{schema}}.commands AS c
                (instance_id, position, seq, kind, state, step, visit, name, payload, attempt, claims,
                 available_at, token, claimed_by, created_at)
            SELECT v_id, COALESCE(x.c->>'position', v_pos),
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_cur_seq ELSE nextval('{{schema}}.command_seq') END,
                   x.c->>'kind',
                   CASE WHEN (x.c->>'continuation')::boolean THEN 'CLAIMED' ELSE 'PENDING' END,
                   x.c->>'step', (x.c->>'visit')::integer, x.c->>'name', NULLIF(x.c->'payload', 'null'::jsonb),
                   1,
                   CASE WHEN (x.c->>'continuation')::boolean THEN 1 ELSE 0 END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_lease
                        ELSE COALESCE((x.c->>'at')::timestamptz,
                                      v_now + make_interval(secs => COALESCE((x.c->>'delay')::float8, 0)))
                   END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_token END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN d->>'worker' END,
                   v_now
            FROM jsonb_array_elements(d->'commands') WITH ORDINALITY AS x(c, ord)
            ORDER BY x.ord
            RETURNING c.id, c.state
        )
        SELECT ins.id INTO v_next FROM ins WHERE ins.state = 'CLAIMED';
    END IF;

    -- 7. Child instances: started by this step, or told that this one ended.
    IF jsonb_array_length(d->'children') > 0 THEN
        PERFORM {{schema}}.start_children(v_id, v_pos, (v_move->>'visit')::integer, d->'children', v_now, v_actor);
    END IF;
    IF jsonb_array_length(d->'notify') > 0 THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                         created_at)
        SELECT (n->>'parent_id')::uuid, n->>'position', nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION',
               'PENDING', (n->>'visit')::integer, n->'payload', v_now, v_now
        FROM jsonb_array_elements(d->'notify') AS n;
    END IF;

    -- 8. History, then outbox.
    IF v_nhist > 0 THEN
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
        SELECT v_id, v_hist + x.ord::integer, v_now, x.h->>'kind', x.h->>'step',
               (x.h->>'visit')::integer, v_cmd, v_actor, NULLIF(x.h->'data', 'null'::jsonb), v_pos
        FROM jsonb_array_elements(d->'history') WITH ORDINALITY AS x(h, ord);
    END IF;
    IF jsonb_array_length(d->'events') > 0 THEN
        INSERT INTO {{schema}}.outbox (event_id, instance_id, type, key, payload, created_at)
        SELECT (e->>'event_id')::uuid, v_id, e->>'type', e->>'key', e->'payload', v_now
        FROM jsonb_array_elements(d->'events') AS e;
    END IF;

    -- Work this segment was blocking (a signal queued behind it) is runnable now. (Two IFs: a
    -- condition holding a subquery runs as a query even when its first operand is false.)
    IF NOT v_cont AND v_end IS NULL THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.commands x
                   WHERE x.instance_id = v_id AND x.position = v_pos
                     AND x.state IN ('PENDING', 'DEFERRED') AND x.available_at <= v_now) THEN
            PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                               WHERE c.oid = '{{schema}}.commands'::regclass),
                              (extract(epoch FROM v_now) * 1000)::bigint::text);
        END IF;
    END IF;

    -- (OUT parameters and RETURN NEXT, not RETURN QUERY: no query to run for the one row.)
    outcome := CASE WHEN v_state IS NULL THEN 'ok' ELSE 'merged' END;
    continuation := v_next;
    lease_until := v_lease;
    committed_at := v_now;
    state_version := v_version;
    state := v_state;  -- the merged state, when this change was carried onto a newer one
    RETURN NEXT;
END $$;

-- Commits of several segments in one statement and one transaction (group commit: one WAL flush).
-- Items come in ascending (instance id, position) order, the lock order; each returns its row, or
-- none when fenced out.
CREATE FUNCTION {{schema}}.commit_decisions(p jsonb)
RETURNS TABLE (idx integer, outcome text, continuation bigint, lease_until timestamptz, committed_at timestamptz,
               state_version bigint, state jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_item jsonb;
    v_i integer := 0;
    r record;
BEGIN
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
END $$;

-- Start an instance: idempotency key, instance row, root position, START command and the
-- baseline history entry in one statement. Returns the new id, or NULL when the key was already
-- used (the caller then reads the dedup row).
CREATE OR REPLACE FUNCTION {{schema}}.start_instance(
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
    INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
    VALUES (p_id, '', 'RUNNING', p_step, 1, v_now, v_now);
    INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, dedup_key, available_at, created_at)
    VALUES (p_id, 1, 'START', 'PENDING', p_step, 1, p_key, v_now, v_now);
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_id, 1, v_now, 'INSTANCE_STARTED', p_step, 1, p_actor,
            jsonb_build_object('state', p_state, 'version', p_version, 'plan_hash', p_plan_hash));
    RETURN p_id;
END $$;

-- Record a signal for one position of an instance (the root: ''). Outcomes: not_found,
-- no_position, ended, unknown_signal, duplicate (same dedup key and payload: the earlier
-- command), conflict (same key, other payload), recorded.
CREATE FUNCTION {{schema}}.signal_position(
    p_instance uuid, p_position text, p_name text, p_payload jsonb, p_dedup_key text, p_fingerprint text,
    p_actor text)
RETURNS TABLE (outcome text, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
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
    IF p_position <> '' AND NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                                        WHERE p.instance_id = p_instance AND p.path = p_position) THEN
        RETURN QUERY SELECT 'no_position', NULL::bigint, v_inst.status;
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
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, name, payload, dedup_key,
                                     available_at, created_at)
    VALUES (p_instance, p_position, nextval('{{schema}}.command_seq'), 'SIGNAL', 'PENDING', p_name, p_payload,
            p_dedup_key, v_now, v_now)
    RETURNING id INTO v_id;
    IF p_dedup_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('SIGNAL', p_instance::text, p_dedup_key, p_fingerprint, v_id::text, v_now);
    END IF;
    RETURN QUERY SELECT 'recorded', v_id, v_inst.status;
END $$;

-- Cancel: settle every open command, close every position, end the instance, and cancel the
-- children that go with it. Idempotent: an ended instance is left as it is and its status returned.
-- A worker still running a handler for it loses its lease and its commit is refused.
CREATE OR REPLACE FUNCTION {{schema}}.cancel_instance(p_instance uuid, p_reason text, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_before text;
    v_after text;
BEGIN
    SELECT i.status INTO v_before FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    v_after := {{schema}}.cancel_tree(p_instance, p_reason, p_actor, true);
    RETURN QUERY SELECT CASE WHEN v_before IN ('COMPLETED', 'CANCELLED') THEN 'unchanged' ELSE 'cancelled' END,
                        v_after;
END $$;

-- Retry a FAILED instance: each failed position's dead commands are superseded and a RETRY
-- command runs its failed step again from its first attempt; dead signals are offered again.
CREATE OR REPLACE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
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
    IF v_inst.status <> 'FAILED' THEN
        RETURN QUERY SELECT 'not_failed', v_inst.status;
        RETURN;
    END IF;
    WITH failed AS (
        UPDATE {{schema}}.positions p SET status = 'RUNNING', error = NULL, updated_at = v_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND x.status = 'FAILED'
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path, p.step, p.visit
    )
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at, created_at)
    SELECT p_instance, failed.path, nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', failed.step,
           failed.visit, v_now, v_now
    FROM failed ORDER BY failed.path;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind <> 'SIGNAL'
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.commands c SET state = 'PENDING', claims = 0, available_at = v_now, token = NULL
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state = 'DEAD' AND x.kind = 'SIGNAL'
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET status = 'RUNNING', error = NULL,
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_RETRIED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('error', v_inst.error, 'positions', v_n));
    RETURN QUERY SELECT 'retried', 'RUNNING'::text;
END $$;

-- ==== version 4 (migration 0004_status_notify) ====

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

-- ==== version 5 (migration 0005_effect_sections) ====
-- Effect sections: how a feature adds an effect type without editing commit_decision.
--
-- A feature's effect writer (store/effects.py) puts its items under d->'ext'->'<section>'; its
-- migration creates the function that carries them out and registers it here. commit_decision calls
-- each registered function whose section the document holds, once, in rank order, inside the same
-- fenced transaction, after the core's positions, instance, commands and children (so the lock order
-- stays instance -> positions -> commands -> child instances -> feature rows by rank -> history ->
-- outbox). The function's signature is fixed:
--     {{schema}}.<function_name>(p_commit jsonb, p_items jsonb, p_now timestamptz) RETURNS void
-- p_commit is the whole commit document (instance, position, command, token, actor, move, ...), p_items
-- the section's array. A function refuses the commit by raising: nothing of it is written.
CREATE TABLE {{schema}}.effect_sections (
    section text PRIMARY KEY,
    rank integer NOT NULL,
    function_name text NOT NULL
);

-- One fenced commit of one decision (see store/effects.py for the document; a section the decision
-- does not use is left out of it). Returns one row:
-- outcome 'ok' (with the continuation's id and lease, and the new state version), 'merged' (the
-- same, the change carried onto a state another position changed meanwhile: the merged state
-- comes back), or 'conflict' (both changed the same part; nothing was written, and the current
-- state comes back), and no row when the position's token no longer holds it (fenced).
CREATE OR REPLACE FUNCTION {{schema}}.commit_decision(d jsonb)
RETURNS TABLE (outcome text, continuation bigint, lease_until timestamptz, committed_at timestamptz,
               state_version bigint, state jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_id uuid := (d->>'instance')::uuid;
    v_pos text := d->>'position';
    v_token uuid := (d->>'token')::uuid;
    v_cmd bigint := (d->>'command')::bigint;
    v_move jsonb := NULLIF(d->'move', 'null'::jsonb);
    v_has_state boolean := d ? 'state';
    v_settle text := d->'settle'->>'state';
    v_nhist integer := COALESCE(jsonb_array_length(d->'history'), 0);
    v_cont boolean := (d->>'continuation')::boolean;
    v_end text := d->'end'->>'status';
    v_actor text := d->>'actor';
    v_lease timestamptz := CASE WHEN v_cont THEN v_now + make_interval(secs => (d->>'lease_seconds')::float8) END;
    v_version bigint;
    v_branches integer;
    v_hist integer;
    v_pstatus text;
    v_status text;
    v_cur_seq bigint;
    v_next bigint;
    v_state jsonb;
    x jsonb;
BEGIN
    -- 1. The instance row (first in the lock order), and the shared state's version.
    SELECT i.state_version, i.branches, i.history_seq INTO v_version, v_branches, v_hist
    FROM {{schema}}.instances i WHERE i.id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_has_state AND v_version <> (d->>'state_version')::bigint THEN
        -- A writer whose lease is gone learns that first: a zombie never re-runs its step.
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                       WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token) THEN
            RETURN;
        END IF;
        -- Another position changed the shared state since this decision read it: carry this
        -- change onto the current state when the two touch different parts of it.
        v_state := {{schema}}.rebase_state((SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id),
                                           d->'changes');
        IF v_state IS NULL THEN
            RETURN QUERY SELECT 'conflict'::text, NULL::bigint, NULL::timestamptz, v_now, v_version,
                                (SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id);
            RETURN;
        END IF;
    END IF;

    -- 2. The fence: this position's lease, moved to its new place.
    UPDATE {{schema}}.positions p SET
        status = COALESCE(v_move->>'status', p.status),
        step = CASE WHEN v_move IS NULL THEN p.step ELSE v_move->>'step' END,
        visit = COALESCE((v_move->>'visit')::integer, p.visit),
        wait = CASE WHEN v_move IS NULL THEN p.wait ELSE NULLIF(v_move->'wait', 'null'::jsonb) END,
        error = CASE WHEN v_move IS NULL THEN p.error ELSE NULLIF(v_move->'error', 'null'::jsonb) END,
        lease_token = CASE WHEN v_cont THEN v_token END,
        lease_until = v_lease,
        lease_owner = CASE WHEN v_cont THEN p.lease_owner END,
        updated_at = v_now
    WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token
    RETURNING p.status INTO v_pstatus;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_pos <> '' AND v_move IS NOT NULL AND v_pstatus IN ('COMPLETED', 'CANCELLED') THEN
        v_branches := v_branches - 1;
    END IF;

    -- 3. Other positions: a fork's branches opened, a join's losers closed (with their children).
    IF d->'open' IS NOT NULL AND d->'open' <> 'null'::jsonb THEN
        v_branches := v_branches + {{schema}}.open_branches(v_id, v_pos, d->'open', v_now);
    END IF;
    IF jsonb_array_length(d->'close') > 0 THEN
        FOR x IN SELECT jsonb_array_elements(d->'close') LOOP
            v_branches := v_branches - {{schema}}.close_branches(v_id, x->>'prefix', x->>'reason', v_now, v_actor);
        END LOOP;
    END IF;

    -- 4. The instance: shared state, status (the root's alone, or all live positions'), history count.
    -- (IF, not one CASE: a CASE holding a subquery runs as a query on every commit.)
    IF v_end IS NOT NULL THEN
        v_status := v_end;
    ELSIF v_branches = 0 AND v_pos = '' THEN
        v_status := v_pstatus;
    ELSE
        v_status := (SELECT CASE WHEN bool_or(p.status = 'FAILED') THEN 'FAILED'
                                 WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END
                     FROM {{schema}}.positions p
                     WHERE p.instance_id = v_id AND p.status IN ('RUNNING', 'WAITING', 'FAILED'));
    END IF;
    UPDATE {{schema}}.instances i SET
        status = COALESCE(v_status, i.status),
        state = CASE WHEN v_state IS NOT NULL THEN v_state WHEN v_has_state THEN d->'state' ELSE i.state END,
        state_version = i.state_version + CASE WHEN v_has_state THEN 1 ELSE 0 END,
        error = CASE WHEN v_pstatus = 'FAILED' THEN v_move->'error' ELSE i.error END,
        step = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN v_move->>'step' ELSE i.step END,
        visit = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN (v_move->>'visit')::integer ELSE i.visit END,
        wait = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN NULLIF(v_move->'wait', 'null'::jsonb) ELSE i.wait END,
        history_seq = i.history_seq + v_nhist,
        branches = v_branches,
        updated_at = v_now,
        ended_at = CASE WHEN v_end IS NOT NULL THEN v_now ELSE i.ended_at END
    WHERE i.id = v_id
    RETURNING i.state_version INTO v_version;

    -- 5. Settle the claimed command, fenced on the same token.
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
    WHERE c.id = v_cmd AND c.token = v_token AND c.state = 'CLAIMED'
    RETURNING c.seq INTO v_cur_seq;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stepstone: command % is not claimed under the token that holds instance % position %',
            v_cmd, v_id, v_pos USING ERRCODE = 'P0001';
    END IF;

    -- 6. Other commands of this instance, in ascending id order.
    IF (d->>'close_timers')::boolean THEN
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'WAIT_LEFT'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.position = v_pos AND x.kind = 'TIMER'
                         AND x.state IN ('PENDING', 'DEFERRED') ORDER BY x.id FOR UPDATE);
    END IF;
    IF v_end IS NOT NULL THEN
        UPDATE {{schema}}.commands c SET state = 'REJECTED', token = NULL, settled_at = v_now,
            last_error = 'INSTANCE_ENDED'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.id <> v_cmd
                         AND x.state IN ('PENDING', 'DEFERRED', 'PARKED', 'DEAD')
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF jsonb_array_length(d->'requeue') > 0 THEN
        UPDATE {{schema}}.commands c SET state = 'PENDING', available_at = v_now, claims = 0
        WHERE c.id = (SELECT x.id FROM {{schema}}.commands x
                      WHERE x.instance_id = v_id AND x.position = v_pos AND x.state = 'PARKED' AND x.kind = 'SIGNAL'
                        AND x.name IN (SELECT jsonb_array_elements_text(d->'requeue'))
                      ORDER BY x.seq, x.id LIMIT 1);
    END IF;
    IF jsonb_array_length(d->'commands') > 0 THEN
        WITH ins AS (
            INSERT INTO {{schema}}.commands AS c
                (instance_id, position, seq, kind, state, step, visit, name, payload, attempt, claims,
                 available_at, token, claimed_by, created_at)
            SELECT v_id, COALESCE(x.c->>'position', v_pos),
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_cur_seq ELSE nextval('{{schema}}.command_seq') END,
                   x.c->>'kind',
                   CASE WHEN (x.c->>'continuation')::boolean THEN 'CLAIMED' ELSE 'PENDING' END,
                   x.c->>'step', (x.c->>'visit')::integer, x.c->>'name', NULLIF(x.c->'payload', 'null'::jsonb),
                   1,
                   CASE WHEN (x.c->>'continuation')::boolean THEN 1 ELSE 0 END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_lease
                        ELSE COALESCE((x.c->>'at')::timestamptz,
                                      v_now + make_interval(secs => COALESCE((x.c->>'delay')::float8, 0)))
                   END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_token END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN d->>'worker' END,
                   v_now
            FROM jsonb_array_elements(d->'commands') WITH ORDINALITY AS x(c, ord)
            ORDER BY x.ord
            RETURNING c.id, c.state
        )
        SELECT ins.id INTO v_next FROM ins WHERE ins.state = 'CLAIMED';
    END IF;

    -- 7. Child instances: started by this step, or told that this one ended.
    IF jsonb_array_length(d->'children') > 0 THEN
        PERFORM {{schema}}.start_children(v_id, v_pos, (v_move->>'visit')::integer, d->'children', v_now, v_actor);
    END IF;
    IF jsonb_array_length(d->'notify') > 0 THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                         created_at)
        SELECT (n->>'parent_id')::uuid, n->>'position', nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION',
               'PENDING', (n->>'visit')::integer, n->'payload', v_now, v_now
        FROM jsonb_array_elements(d->'notify') AS n;
    END IF;

    -- 7b. Feature sections (effect_sections), in rank order: the rows a feature added after the core
    -- (tasks, subscriptions, compensations, ...) come after the commands and children in the lock order
    -- and before history and the outbox. A decision that uses none leaves 'ext' out: no lookup.
    IF d ? 'ext' THEN
        FOR x IN SELECT to_jsonb(s) FROM {{schema}}.effect_sections s
                 WHERE d->'ext' ? s.section ORDER BY s.rank, s.section LOOP
            EXECUTE format('SELECT {{schema}}.%I($1, $2, $3)', x->>'function_name')
                USING d, d->'ext'->(x->>'section'), v_now;
        END LOOP;
    END IF;

    -- 8. History, then outbox.
    IF v_nhist > 0 THEN
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
        SELECT v_id, v_hist + x.ord::integer, v_now, x.h->>'kind', x.h->>'step',
               (x.h->>'visit')::integer, v_cmd, v_actor, NULLIF(x.h->'data', 'null'::jsonb), v_pos
        FROM jsonb_array_elements(d->'history') WITH ORDINALITY AS x(h, ord);
    END IF;
    IF jsonb_array_length(d->'events') > 0 THEN
        INSERT INTO {{schema}}.outbox (event_id, instance_id, type, key, payload, created_at)
        SELECT (e->>'event_id')::uuid, v_id, e->>'type', e->>'key', e->'payload', v_now
        FROM jsonb_array_elements(d->'events') AS e;
    END IF;

    -- Work this segment was blocking (a signal queued behind it) is runnable now. (Two IFs: a
    -- condition holding a subquery runs as a query even when its first operand is false.)
    IF NOT v_cont AND v_end IS NULL THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.commands x
                   WHERE x.instance_id = v_id AND x.position = v_pos
                     AND x.state IN ('PENDING', 'DEFERRED') AND x.available_at <= v_now) THEN
            PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                               WHERE c.oid = '{{schema}}.commands'::regclass),
                              (extract(epoch FROM v_now) * 1000)::bigint::text);
        END IF;
    END IF;

    -- (OUT parameters and RETURN NEXT, not RETURN QUERY: no query to run for the one row.)
    outcome := CASE WHEN v_state IS NULL THEN 'ok' ELSE 'merged' END;
    continuation := v_next;
    lease_until := v_lease;
    committed_at := v_now;
    state_version := v_version;
    state := v_state;  -- the merged state, when this change was carried onto a newer one
    RETURN NEXT;
END $$;

-- ==== version 13 (migration 0013_api_tokens) ====

-- API tokens of the management HTTP API and the web UI (stepstone serve).
--
-- A token is shown once, when `stepstone tokens create` makes it; only its SHA-256 is kept (a token
-- is 256 random bits, so a fast hash is enough: there is nothing to guess). Each token grants one
-- role in one scope ('*': every scope). Revoking sets revoked_at; the row stays for the record.
CREATE TABLE {{schema}}.api_tokens (
    id uuid PRIMARY KEY,
    name text NOT NULL,
    token_hash text NOT NULL UNIQUE,
    role text NOT NULL CHECK (role IN ('viewer', 'task_worker', 'operator', 'admin')),
    scope text NOT NULL,
    created_at timestamptz NOT NULL,
    created_by text,
    revoked_at timestamptz
);

-- The instances list of one scope, newest first (the API's keyset pagination on (created_at, id)).
CREATE INDEX instances_scope_newest ON {{schema}}.instances (scope, created_at DESC, id DESC);

-- One instance's events, published or not (the instance page; outbox_unsent_instance covers only
-- the unpublished ones).
CREATE INDEX outbox_instance ON {{schema}}.outbox (instance_id, id);
