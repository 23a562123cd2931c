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

-- ==== version 7 (migration 0007_tasks_messages) ====
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
