-- stepstone schema: what the migrations build, in their order, one section a version.
-- A function a later migration replaces is changed where it is defined, and that version's section says so
-- in one line: each function has one definition here (a PL/pgSQL one where it first appears, an SQL one,
-- whose body is checked when it is created, where its last version needs it). The migrations repeat each
-- replaced function whole. tests/test_schema_matches_migrations.py checks both.
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

-- The one clock, in plpgsql: the same expression as before, but its plan is kept for the session. As a
-- SQL-language function (not inlinable: it reads a table) it was parsed and planned again in every
-- statement that calls it, once per call site (a claim had nine): 10% of the server's CPU in the
-- throughput workload (perf: fmgr_sql -> raw_parser, pg_plan_query).
CREATE FUNCTION {{schema}}.db_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$ BEGIN RETURN now() + (SELECT offset_by FROM {{schema}}.clock); END $$;

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
    wait jsonb,  -- written until version 32; what an instance waits for is its root position's wait
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
CREATE INDEX instances_created ON {{schema}}.instances (created_at, id);  -- read backwards: newest first
CREATE INDEX instances_status_created ON {{schema}}.instances (status, created_at, id);

-- The per-instance ordered command log. A command is claimable when it is the
-- head of its instance's queue (ordered by seq, then id; a continuation inherits
-- its predecessor's seq so it runs before anything queued behind it), available
-- (available_at <= db_now()) and PENDING, DEFERRED or CLAIMED under an expired
-- lease. For a CLAIMED command available_at is the lease expiry its claim or the
-- last renewal set; the lease itself is the position's (a continuation in place
-- moves only that one on, version 30). A TIMER before its fire time blocks nothing.
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

-- Expired leases are found through an index of their own, so a claim takes back the commands of a
-- dead worker before any queued backlog (ready work: commands_ready, version 41).
CREATE INDEX commands_leased ON {{schema}}.commands (available_at, id)
    WHERE state = 'CLAIMED';
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
-- schema; the payload is its available time in epoch milliseconds, a hint only, and its
-- definition after a colon (version 38): a worker that does not serve it stays asleep.
CREATE FUNCTION {{schema}}.notify_command() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('stepstone_' || TG_TABLE_SCHEMA,
                      (extract(epoch FROM NEW.available_at) * 1000)::bigint::text || COALESCE(':' || NEW.definition, ''));
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

-- Start an instance: idempotency key, instance row, root position, START command and the baseline
-- history entry, in one statement (one executor run instead of five). Returns the new id, or NULL when
-- the key was already used (the caller then reads the dedup row). The instance rows are written only
-- when there is no key or the key's row was inserted here.
CREATE FUNCTION {{schema}}.start_instance(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text,
    p_state jsonb, p_step text, p_business_key text, p_key text, p_fingerprint text,
    p_parent uuid, p_actor text)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
BEGIN
    WITH clock AS (
        SELECT {{schema}}.db_now() AS now
    ), key AS (
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        SELECT 'START', p_scope || '/' || p_definition, p_key, p_fingerprint, p_id::text, clock.now FROM clock
        WHERE p_key IS NOT NULL
        ON CONFLICT DO NOTHING
        RETURNING 1
    ), go AS (
        SELECT clock.now FROM clock WHERE p_key IS NULL OR EXISTS (SELECT 1 FROM key)
    ), inst AS (
        INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step,
                                          visit, business_key, parent_id, next_seq, history_seq,
                                          created_at, updated_at)
        SELECT p_id, p_scope, p_definition, p_version, p_plan_hash, 'PENDING', p_state, p_step,
               1, p_business_key, p_parent, 2, 1, go.now, go.now FROM go
        RETURNING id
    ), pos AS (
        INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
        SELECT p_id, '', 'RUNNING', p_step, 1, go.now, go.now FROM go
    ), cmd AS (
        INSERT INTO {{schema}}.commands (instance_id, definition, seq, kind, state, step, visit, dedup_key,
                                         available_at, created_at)
        SELECT p_id, p_definition, 1, 'START', 'PENDING', p_step, 1, p_key, go.now, go.now FROM go
    ), hist AS (
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
        SELECT p_id, 1, go.now, 'INSTANCE_STARTED', p_step, 1, p_actor,
               jsonb_build_object('state', p_state) FROM go
    )
    SELECT inst.id FROM inst
    INTO v_id;
    RETURN v_id;
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
    -- The plan the instance runs (its plan hash): another plan stored for its version is not its plan, and a
    -- plan that is not stored declares nothing known, as for an instance no registration knows.
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope IN (v_inst.scope, v_inst.definition_scope)
                     AND d.definition_id = v_inst.definition_id AND d.version = v_inst.version
                     AND d.plan_hash = v_inst.plan_hash AND d.plan->'signals' ? p_name) THEN
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

-- Cancel: settle every open command, close every position, end the instance, and cancel the
-- children that go with it. Idempotent: an ended instance is left as it is and its status returned.
-- A worker still running a handler for it loses its lease and its commit is refused.
CREATE FUNCTION {{schema}}.cancel_instance(p_instance uuid, p_reason text, p_actor text)
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
-- command runs its failed step again from its first attempt, bounded by the step's deadline again;
-- dead signals and messages are offered again, and a wait that failed because the message it took was
-- dead-lettered waits again for that message alone (version 82). An instance deadline that passed is
-- passed for good. A child whose parent no longer awaits it is refused (outcome not_awaited, version 83).
CREATE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_paths text[];
    v_waits text[];
    v_completions bigint[];
    v_task record;
    v_status text;
    v_timer bigint;
    v_plan jsonb;
    v_report boolean;
    v_standing text;
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
    -- A child whose parent no longer awaits it (child_standing, version 83) is refused, and nothing changes:
    -- its steps would run again for a result nothing takes, beside what the parent went on with. Its
    -- parent's rows are read, not locked (a child never waits on its parent's rows): a replay of the
    -- parent locks this row before it writes, so this reads the parent as that replay left it.
    -- A child whose failure report its parent has not applied yet (queued, or under the worker applying it) is
    -- refused while the parent still awaits it (outcome report_pending, version 89): applied, the report may
    -- take the parent past the child (on_failure, compensation). The report is read first, each read in its
    -- own snapshot: one seen applied is applied in the parent's standing read after it. The report exists:
    -- the child's commit that failed it queued it, and this row's lock waited for that commit.
    IF v_inst.parent_id IS NOT NULL THEN
        v_report := EXISTS (SELECT 1 FROM {{schema}}.commands x
                            WHERE x.instance_id = v_inst.parent_id AND x.kind = 'CHILD_COMPLETION'
                              AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                              AND x.payload->>'child_id' = p_instance::text);
        v_standing := {{schema}}.child_standing(v_inst);
        IF v_standing = 'not_awaited' THEN
            RETURN QUERY SELECT 'not_awaited', v_inst.status;
            RETURN;
        END IF;
        IF v_report AND v_standing = 'awaited' THEN
            RETURN QUERY SELECT 'report_pending', v_inst.status;
            RETURN;
        END IF;
    END IF;
    -- The instance deadline passed while it was FAILED and its timer has not fired: it fires here, as a
    -- worker's claim would have fired it (core/saga.py, _deadline).
    SELECT c.id INTO v_timer FROM {{schema}}.commands c
    WHERE c.instance_id = p_instance AND c.position = '$saga' AND c.kind = 'TIMER' AND c.name = 'deadline'
      AND ((c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND c.available_at <= v_now
           OR (c.state = 'CLAIMED') IS TRUE)  -- claimed: it was due; a worker's late commit is refused
    ORDER BY c.id LIMIT 1 FOR UPDATE;
    IF FOUND THEN
        UPDATE {{schema}}.commands c SET state = 'COMPLETE', token = NULL, settled_at = v_now
        WHERE c.id = v_timer;
        PERFORM {{schema}}.saga_history(p_instance, 'DEADLINE_PASSED', NULL, NULL, '$saga', v_timer, p_actor,
                                        jsonb_build_object('cause', 'timed_out', 'status_before', 'FAILED',
                                                           'outcome', 'left FAILED for an operator'), v_now);
        SELECT i.history_seq INTO v_inst.history_seq FROM {{schema}}.instances i WHERE i.id = p_instance;
    END IF;
    -- A wait whose message's command was dead-lettered failed there with its wait kept (core/transitions.py,
    -- _dead_letter), its subscription used by that message. A RETRY entered the wait again and the dead command
    -- was superseded: the message, delivered to this instance, was never applied, and the wait opened anew for
    -- another (version 82). Such a wait waits again as it was (its subscription still used, so no other message
    -- is given to it) and its dead message is offered to it again below; every other failed position runs its
    -- failed step again (RETRY). So does a join whose branch's report was dead-lettered (its count kept; a
    -- RETRY forked again: every branch ran again, one waiting for a signal it had taken waited for it again),
    -- an external step whose task's completion was (a RETRY opened the task again: its work done twice) and a
    -- human task step whose task's completion or own timer was (a RETRY queued the task's timers a second
    -- time: the second reminder or escalation of the visit crashed on the first one's outbox event)
    -- (version 86).
    WITH failed AS (
        UPDATE {{schema}}.positions p SET
            status = CASE WHEN p.wait IS NOT NULL
                               AND EXISTS (SELECT 1 FROM {{schema}}.commands m
                                           WHERE m.instance_id = p.instance_id AND m.state = 'DEAD'
                                             AND (p.wait->>'kind', m.kind) IN (
                                                     ('signal', 'MESSAGE'), ('join', 'BRANCH_DONE'),
                                                     ('external', 'EXTERNAL_COMPLETION'),
                                                     ('task', 'TASK_COMPLETION'), ('task', 'TIMER'))
                                             AND m.position = p.path AND m.step = p.step AND m.visit = p.visit)
                          THEN 'WAITING' ELSE 'RUNNING' END,
            error = NULL, updated_at = v_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND x.status = 'FAILED'
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path, p.step, p.visit, p.status
    ), queued AS (
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                         created_at)
        SELECT p_instance, failed.path, nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', failed.step,
               failed.visit, v_now, v_now
        FROM failed WHERE failed.status = 'RUNNING' ORDER BY failed.path
        RETURNING id
    )
    SELECT COALESCE(array_agg(failed.path), '{}'),
           COALESCE(array_agg(failed.path) FILTER (WHERE failed.status = 'WAITING'), '{}')
    INTO v_paths, v_waits FROM failed;  -- (queued runs unread)
    -- Each retried step's deadline, counted from now: the pending timers of those positions' steps are
    -- superseded (ascending id) and new ones queued. The positions just retried say which steps.
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   JOIN {{schema}}.positions r ON r.instance_id = p_instance AND r.path = ANY (v_paths)
                        AND r.path = x.payload->>'position' AND r.step = x.step
                   WHERE x.instance_id = p_instance AND x.position = '$saga' AND x.kind = 'TIMER'
                     AND x.name = 'step_deadline' AND (x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE
                   ORDER BY x.id FOR UPDATE OF x);
    -- The deadlines of the plan the instance runs (its plan hash), in the registration its pin was admitted
    -- against or in its own scope (registered there after it started): none known when it is not stored.
    SELECT d.plan INTO v_plan FROM {{schema}}.definitions d
    WHERE d.scope IN (v_inst.definition_scope, v_inst.scope) AND d.definition_id = v_inst.definition_id
      AND d.version = v_inst.version AND d.plan_hash = v_inst.plan_hash
    ORDER BY d.scope = v_inst.definition_scope DESC LIMIT 1;
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(v_plan->'steps') AS s WHERE s ? 'deadline') THEN
        PERFORM {{schema}}.open_saga_position(p_instance, v_now);
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                         available_at, created_at)
        SELECT p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', r.step, r.visit,
               'step_deadline', jsonb_build_object('position', r.path, 'step', r.step, 'visit', r.visit),
               v_now + make_interval(secs => (s->'deadline'->>'seconds')::float8), v_now
        FROM {{schema}}.positions r
        CROSS JOIN LATERAL jsonb_array_elements(v_plan->'steps') AS s
        WHERE r.instance_id = p_instance AND r.path = ANY (v_paths) AND s->>'name' = r.step AND s ? 'deadline'
        ORDER BY r.path;
    END IF;
    -- A dead message is offered again as a dead signal is (version 82; it was superseded, and lost): to the
    -- wait it was delivered to when that wait waits again (above), else applied as any message that finds its
    -- wait left (parked, or, taken from the buffer, handed on). A dead branch's report, a dead external
    -- task's completion and a dead timer are offered again to the step that waits again at their visit
    -- (version 86), and so are the reports of other branches parked at that join while it was failed
    -- (core/transitions.py, _branch_done): the join counts each once. Parked reports of a join that forks
    -- again (RETRY) are of the branches that run again, which report again: superseded. Any other dead
    -- command is superseded (a human task's completion among them: its task is given back below).
    WITH held AS (
        -- Every dead command, and the reports parked at a retried join; `offered`: PENDING again, else
        -- superseded (one pass, ascending id).
        SELECT x.id, x.kind IN ('SIGNAL', 'MESSAGE')
                     OR x.kind IN ('BRANCH_DONE', 'EXTERNAL_COMPLETION', 'TIMER') AND (r.path = ANY (v_waits)) IS TRUE
                     AS offered
        FROM {{schema}}.commands x
        LEFT JOIN {{schema}}.positions r ON r.instance_id = p_instance AND r.path = x.position
             AND r.step = x.step AND r.visit = x.visit
        WHERE x.instance_id = p_instance
          AND (x.state = 'DEAD' OR x.state = 'PARKED' AND x.kind = 'BRANCH_DONE' AND (r.path = ANY (v_paths)) IS TRUE)
        ORDER BY x.id FOR UPDATE OF x
    ), again AS (
        UPDATE {{schema}}.commands c SET state = 'PENDING', claims = 0, available_at = v_now, token = NULL
        WHERE c.id IN (SELECT held.id FROM held WHERE held.offered)
    ), gone AS (
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'RETRIED'
        WHERE c.id IN (SELECT held.id FROM held WHERE NOT held.offered)
        RETURNING c.id, c.kind
    )
    SELECT COALESCE(array_agg(gone.id) FILTER (WHERE gone.kind = 'TASK_COMPLETION'), '{}')
    INTO v_completions FROM gone;
    -- RUNNING while a position runs; when every open one waits (only waits that wait again: a task given back
    -- has nothing queued that would commit and say so), WAITING, as a commit would say (version 86).
    SELECT COALESCE(CASE WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END, 'RUNNING')
    INTO v_status FROM {{schema}}.positions p
    WHERE p.instance_id = p_instance AND p.status IN ('RUNNING', 'WAITING');
    UPDATE {{schema}}.instances i SET status = v_status, error = NULL,
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_RETRIED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('error', v_inst.error, 'positions', cardinality(v_paths)));
    -- A human task whose completion was dead-lettered is given back, as a refused completion gives it back:
    -- its task step waits again (above) with the task's own reminder, due date and expiry, which waited
    -- behind the completion. The RETRY that entered the step again gave it back too, but queued those
    -- timers a second time beside the first: the second reminder or escalation of the visit crashed its
    -- segment on the outbox event the first had written (version 86).
    FOR v_task IN SELECT k.id, k.position, k.step, k.visit, k.completion FROM {{schema}}.tasks k
                  WHERE k.instance_id = p_instance AND k.status = 'COMPLETING'
                    AND k.completion_command = ANY (v_completions)
                  ORDER BY k.id FOR UPDATE LOOP
        UPDATE {{schema}}.tasks k SET status = 'OPEN', completion = NULL, completion_command = NULL,
            updated_at = v_now
        WHERE k.id = v_task.id;
        PERFORM {{schema}}.append_history(p_instance, v_task.position, 'TASK_COMPLETION_REFUSED', v_task.step,
                                          v_task.visit, p_actor, jsonb_build_object(
                                              'task_id', v_task.id, 'decision', v_task.completion->>'decision',
                                              'actor', v_task.completion->>'actor', 'reason', 'DEAD_LETTERED'),
                                          v_now);
    END LOOP;
    RETURN QUERY SELECT 'retried', v_status;
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

-- Cancel one instance and everything under it (replaces migration 0002's): its open commands, each
-- with its own history entry, its positions, and the children cancelled with their parent.
-- `p_notify` tells the parent (an operator's cancel of a child). Returns the status afterwards.
CREATE FUNCTION {{schema}}.cancel_tree(p_instance uuid, p_reason text, p_actor text, p_notify boolean)
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

-- Cancel the live branches under a path prefix (a join's losers): their positions, open commands
-- and the children still running (one that ended is a record, FAILED ones above all). Returns how many
-- positions it closed. A child that COMPLETED there, whose report the branch had not applied, is recorded
-- as the report would have recorded it (reported_children, version 92): a later saga compensates it with the
-- branch's completed steps.
CREATE FUNCTION {{schema}}.close_branches(p_instance uuid, p_prefix text, p_reason text, p_now timestamptz,
                                          p_actor text)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
    v_len integer := length(p_prefix);
    v_child uuid;
    v_closed text[];
BEGIN
    WITH closed AS (
        UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
            lease_owner = NULL, updated_at = p_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND left(x.path, v_len) = p_prefix
                                            AND x.status NOT IN ('COMPLETED', 'CANCELLED')
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path)
    SELECT coalesce(array_agg(c.path), '{}') INTO v_closed FROM closed c;
    v_n := cardinality(v_closed);
    UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = p_now,
        last_error = 'BRANCH_CANCELLED: ' || p_reason
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND left(x.position, v_len) = p_prefix
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    FOR v_child IN SELECT i.id FROM {{schema}}.instances i
                   WHERE i.parent_id = p_instance AND left(i.parent_position, v_len) = p_prefix
                     AND i.cancel_with_parent AND NOT {{schema}}.is_ended(i.status) ORDER BY i.id LOOP
        PERFORM {{schema}}.cancel_tree(v_child, 'branch cancelled: ' || p_reason, p_actor, false);
    END LOOP;
    -- A child that completed in a branch closed here, its report not applied: recorded as the report would
    -- have (version 92). Read after the loop: a child whose last commit landed meanwhile was waited for by
    -- cancel_tree, so it is seen COMPLETED now.
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT p_instance, r.path, r.step, r.visit, jsonb_build_object('kind', 'child', 'child_id', r.child_id), p_now
    FROM {{schema}}.reported_children(p_instance, p_prefix, v_closed) r
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.compensations k
                      WHERE k.instance_id = p_instance AND k.recorded->>'kind' = 'child'
                        AND k.recorded->>'child_id' = r.child_id::text)
    ORDER BY r.child_id;
    RETURN v_n;
END $$;

-- A child gets its workflow's deadlines as a start does (docs/sagas.md, "Deadlines"). start_children
-- started a child step's child without its workflow's default instance deadline and without its action
-- start step's deadline, so such a child never timed out. The parent's worker, which selects the child's
-- version, now names both in each child of the commit ('deadline_seconds', 'start_deadline_seconds'), and
-- start_children schedules them for a child it inserts (schedule_start_deadlines). A child of a worker
-- of before carries neither: nothing is scheduled, as before.
CREATE FUNCTION {{schema}}.start_children(p_instance uuid, p_position text, p_visit integer,
                                                     p_children jsonb, p_now timestamptz, p_actor text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_scope text;
    v_child {{schema}}.instances%ROWTYPE;
    v_status text;
    v_state jsonb;
    v_paths jsonb;
    v_path jsonb;
    v_payload jsonb;
    v_started boolean;
    c jsonb;
BEGIN
    SELECT i.scope INTO v_scope FROM {{schema}}.instances i WHERE i.id = p_instance;
    FOR c IN SELECT jsonb_array_elements(p_children) ORDER BY 1 LOOP
        -- A child that exists already (the step runs again at the visit that started it: an operator's
        -- retry) is not inserted again: the pin admission (a BEFORE INSERT trigger) fires before ON
        -- CONFLICT finds the row, and refused the version that child runs once it was deprecated.
        v_started := false;
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.instances i WHERE i.id = (c->>'id')::uuid) THEN
            INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, status, state, step,
                                              visit, parent_id, parent_position, parent_visit, cancel_with_parent,
                                              next_seq, history_seq, created_at, updated_at)
            VALUES ((c->>'id')::uuid, v_scope, c->>'definition_id', (c->>'version')::integer, c->>'plan_hash',
                    'PENDING', c->'state', c->>'step', 1, p_instance, p_position, p_visit,
                    (c->>'cancel_with_parent')::boolean, 2, 1, p_now, p_now)
            ON CONFLICT (id) DO NOTHING;
            v_started := FOUND;
        END IF;
        IF v_started THEN
            INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
            VALUES ((c->>'id')::uuid, '', 'RUNNING', c->>'step', 1, p_now, p_now);
            INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                             created_at)
            VALUES ((c->>'id')::uuid, '', 1, 'START', 'PENDING', c->>'step', 1, p_now, p_now);
            INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
            VALUES ((c->>'id')::uuid, 1, p_now, 'INSTANCE_STARTED', c->>'step', 1, p_actor,
                    jsonb_build_object('state', c->'state', 'parent', p_instance, 'parent_position', p_position));
            PERFORM {{schema}}.schedule_start_deadlines((c->>'id')::uuid, NULL, (c->>'deadline_seconds')::float8,
                                                        c->>'step', (c->>'start_deadline_seconds')::float8);
            CONTINUE;
        END IF;
        -- No lock on the child: it never waits on its parent, and a child ending meanwhile has queued its
        -- report in the same transaction that ended it, which the check below then sees.
        SELECT * INTO v_child FROM {{schema}}.instances i WHERE i.id = (c->>'id')::uuid AND i.parent_id = p_instance;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        v_status := CASE WHEN {{schema}}.is_ended(v_child.status) THEN v_child.status
                         WHEN v_child.status = 'COMPENSATING' AND v_child.saga->>'cause' = 'failed'
                              AND NOT v_child.saga ? 'record' THEN 'FAILED' END;
        IF v_status IS NULL OR EXISTS (
            SELECT 1 FROM {{schema}}.commands x
            WHERE x.instance_id = p_instance AND x.position = p_position AND x.kind = 'CHILD_COMPLETION'
              AND x.state IN ('PENDING', 'DEFERRED', 'PARKED') AND x.payload->>'child_id' = v_child.id::text) THEN
            CONTINUE;
        END IF;
        IF v_status = 'COMPLETED' THEN
            v_state := v_child.state;
            -- The child's own plan's paths; when it is not stored, every path a stored plan of its workflow
            -- marks (pinned_sensitive_paths, version 80).
            v_paths := {{schema}}.pinned_sensitive_paths(v_child.scope, COALESCE(v_child.definition_scope,
                                                                                  v_child.scope),
                                                         v_child.definition_id, v_child.version, v_child.plan_hash);
            IF jsonb_typeof(v_paths) = 'array' THEN
                FOR v_path IN SELECT jsonb_array_elements(v_paths) LOOP
                    v_state := {{schema}}.redact_path(v_state, ARRAY(SELECT jsonb_array_elements_text(v_path)));
                END LOOP;
            END IF;
            v_payload := jsonb_build_object('child_id', v_child.id, 'status', v_status, 'state', v_state);
        ELSE
            v_payload := jsonb_build_object('child_id', v_child.id, 'status', v_status, 'error', jsonb_strip_nulls(
                jsonb_build_object(
                    'step', v_child.error->>'step',
                    'type', COALESCE(v_child.error->>'type', initcap(v_status)),
                    'message', 'already ' || v_child.status || ' when the step ran again'
                               || CASE WHEN v_child.status IN ('FAILED', 'COMPENSATION_FAILED')
                                       THEN ' (retry the child first, then this instance)' ELSE '' END
                               || COALESCE(': ' || COALESCE(v_child.error->>'message', v_child.saga->>'reason'), ''))));
        END IF;
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                         created_at)
        VALUES (p_instance, p_position, nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION', 'PENDING', p_visit,
                v_payload, p_now, p_now);
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

-- commit_decision(d jsonb): defined in the version 5 section (migration 0005 replaced it).

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

-- start_instance changes here; its one definition is in the version 1 section.

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
    -- The plan the instance runs (its plan hash): another plan stored for its version is not its plan, and a
    -- plan that is not stored declares nothing known, as for an instance no registration knows.
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope IN (v_inst.scope, v_inst.definition_scope)
                     AND d.definition_id = v_inst.definition_id AND d.version = v_inst.version
                     AND d.plan_hash = v_inst.plan_hash AND d.plan->'signals' ? p_name) THEN
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
    IF {{schema}}.is_terminal(v_inst.status) THEN
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

-- cancel_instance changes here; its one definition is in the version 1 section.

-- retry_instance changes here; its one definition is in the version 1 section.

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
    v_history jsonb := d->'history';
    v_nhist integer := COALESCE(jsonb_array_length(d->'history'), 0);
    v_notify jsonb := d->'notify';
    v_cont boolean := (d->>'continuation')::boolean;
    v_end text := d->'end'->>'status';
    v_actor text := d->>'actor';
    v_lease timestamptz := CASE WHEN v_cont THEN v_now + make_interval(secs => (d->>'lease_seconds')::float8) END;
    v_follow jsonb := d->'next';
    v_commands jsonb := COALESCE(d->'commands', '[]'::jsonb);
    v_version bigint;
    v_definition text;
    v_pinned integer;
    v_branches integer;
    v_hist integer;
    v_pstatus text;
    v_before text;
    v_stops boolean := false;
    v_side jsonb;
    v_status text;
    v_cur_seq bigint;
    v_next bigint;
    v_state jsonb;
    v_timer jsonb;
    v_timer_at integer;
    v_in_place bigint;
    v_deadline timestamptz;
    v_due bigint;
    v_due_pos text;
    x jsonb;
BEGIN
    -- 1. The instance row (first in the lock order), and the shared state's version.
    SELECT i.state_version, i.branches, i.history_seq, i.definition_id, i.version, i.status, i.deadline_at
    INTO v_version, v_branches, v_hist, v_definition, v_pinned, v_before, v_deadline
    FROM {{schema}}.instances i WHERE i.id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_pinned <> (d->>'version')::integer  -- (a previous release sends no version: NULL, no test)
       OR (v_pos = '$saga' AND v_settle = 'COMPLETE' AND {{schema}}.is_terminal(v_before))
    THEN
        -- A migration moved the instance to another version after this segment's claim read it: a claim
        -- whose statement ran while the migration committed locks the position as the migration left it
        -- but reads the instance row of its snapshot, pin included. What the segment decided followed a
        -- plan the instance no longer has, so nothing of it is written: the claim is given back, and the
        -- command runs again at once under the new plan (migration 0038; the worker counts it fenced).
        -- Likewise a deadline (or step deadline) decided on the saga position while the instance ran, whose
        -- commit comes after another position's commit ended the instance: the saga position's lease is
        -- not the one the end took, so the fence let it through and it compensated a completed instance.
        -- Given back, the timer runs again on the ended instance and is settled STALE (migration 0051).
        WITH pos AS (
            UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
            WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token
            RETURNING p.path
        )
        UPDATE {{schema}}.commands c SET state = 'PENDING', token = NULL, available_at = v_now,
            claims = GREATEST(c.claims - 1, 0)
        WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE AND EXISTS (SELECT 1 FROM pos);
        RETURN;
    END IF;
    -- A commit that would end the instance once its deadline has passed while the deadline's timer (on
    -- '$saga') has not fired: no slot was free to claim the timer (one slot, or every slot busy), and the
    -- instance completed past its deadline (migration 0061). The deadline wins, as if its timer had fired
    -- just before: nothing of this decision is written, the timer is settled as fired, DEADLINE_PASSED is
    -- recorded and the saga begins (timed_out: every position closed and its lease taken, the open
    -- commands settled, this one too, what the instance completed compensated, then TIMED_OUT), and the
    -- worker counts the commit fenced. A timer a live worker has claimed (or is claiming) is that worker's
    -- to fire: this commit is refused and writes nothing; one whose worker's lease has expired is taken
    -- from it and fired here (fire_deadline_timer, migration 0065). The deadline is on the row this commit
    -- locks, so an ordinary commit pays no lookup: the timer is looked up only by a commit that ends the
    -- instance after its deadline.
    IF v_end IS NOT NULL AND v_deadline <= v_now AND v_before IN ('PENDING', 'RUNNING', 'WAITING') THEN
        SELECT x.id INTO v_due FROM {{schema}}.commands x
        WHERE x.instance_id = v_id AND x.position = '$saga' AND x.kind = 'TIMER' AND x.name = 'deadline'
          AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
        ORDER BY x.id LIMIT 1;
        IF FOUND THEN
            -- This position first (the lock order), fenced as every commit is: a zombie writes nothing.
            PERFORM 1 FROM {{schema}}.positions p
            WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token FOR UPDATE;
            IF FOUND THEN
                -- Settled first (the saga settles every open command, and this one fired), then what the
                -- timer's own commit writes (core/saga.py, _deadline), in the same order.
                IF {{schema}}.fire_deadline_timer(v_id, v_due, v_now, d->>'worker') THEN
                    PERFORM {{schema}}.saga_history(v_id, 'DEADLINE_PASSED', NULL, NULL, '$saga', v_due, v_actor,
                                                    jsonb_build_object('cause', 'timed_out', 'status_before', v_before),
                                                    v_now);
                    PERFORM {{schema}}.saga_begin(v_id, 'timed_out', NULL, v_actor, v_now, '$saga');
                END IF;
            END IF;
            RETURN;
        END IF;
    END IF;
    -- A run of steps going on in place never lets go of its position, so the instance's deadline timer
    -- (on '$saga') waits for a free slot: at one slot, or with every slot busy, it was never taken before
    -- the run ended the instance, which then completed past its deadline (migration 0051). Once the
    -- deadline has passed while its timer is still open, the next step is queued instead (behind the due
    -- timer, which a claim takes first: it is older). The deadline is on the row this commit locks; the
    -- timer is looked up only once it has passed (two IFs: a condition holding a subquery runs as a query
    -- even when its first operand is false).
    IF v_cont AND v_follow IS NOT NULL AND v_deadline <= v_now THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.commands x
                   WHERE x.instance_id = v_id AND x.position = '$saga' AND x.kind = 'TIMER'
                     AND x.name = 'deadline' AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) THEN
            v_cont := false;
            v_lease := NULL;
            v_commands := v_commands || jsonb_build_array(v_follow || '{"continuation": false}'::jsonb);
            v_follow := NULL;
        END IF;
    END IF;
    -- A handler's run of a step with a deadline (WithinStepDeadline) committing once that deadline has
    -- passed while its timer (on '$saga') has not fired: no slot was free to claim the timer (one slot, or
    -- every slot busy), and the step went on as if in time (migration 0057). The deadline wins: nothing of
    -- this decision is written, the step is interrupted here as the timer would interrupt it (the timer
    -- settled as fired, STEP_DEADLINE_PASSED, the step's commands settled, its position's 'step_deadline'
    -- TIMER queued, which goes to on_deadline), and the worker counts the commit fenced. A timer a live
    -- worker has claimed (or is claiming) is that worker's to fire: this commit is refused and writes
    -- nothing; one whose worker's lease has expired is taken from it and fired here (migration 0065).
    -- A signal, message or timer leaving a wait or timer step with a deadline (`late`) does the same, and
    -- its command is settled as the wait's leaving would settle it (a signal or message PARKED, with its
    -- entry, a timer STALE), its position's lease given back: also while a worker holds the timer (whose
    -- commit interrupts the step), and once the timer has fired and its TIMER waits on this position
    -- behind this command, for a command queued before it would otherwise leave the wait as if in time
    -- (migration 0061). Looked up only for such a commit, and written only once the deadline has passed.
    IF d ? 'step_deadline' THEN
        -- The visit's deadline timer, due or held by a worker (one a visit).
        SELECT x.id, x.position INTO v_due, v_due_pos FROM {{schema}}.commands x
        WHERE x.instance_id = v_id AND x.position = '$saga' AND x.kind = 'TIMER' AND x.name = 'step_deadline'
          AND x.step = d->'step_deadline'->>'step' AND x.visit = (d->'step_deadline'->>'visit')::integer
          AND x.payload->>'position' = v_pos AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
          AND (x.state = 'CLAIMED' OR x.available_at <= v_now)
        ORDER BY x.id LIMIT 1;
        IF NOT FOUND AND d->'step_deadline' ? 'late' THEN
            -- For a command leaving a wait: the TIMER a fired deadline queued on this position for this visit
            -- (a query of its own, by the position's queue index, as the one above).
            SELECT x.id, x.position INTO v_due, v_due_pos FROM {{schema}}.commands x
            WHERE x.instance_id = v_id AND x.position = v_pos AND x.kind = 'TIMER' AND x.name = 'step_deadline'
              AND x.step = d->'step_deadline'->>'step' AND x.visit = (d->'step_deadline'->>'visit')::integer
              AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
            ORDER BY x.id LIMIT 1;
        END IF;
        IF FOUND THEN
            -- This position first (the lock order), fenced as every commit is: a zombie writes nothing.
            PERFORM 1 FROM {{schema}}.positions p
            WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token FOR UPDATE;
            IF FOUND THEN
                -- The deadline's timer (not the TIMER it queued), fired here when no live worker holds it.
                IF v_due_pos = '$saga' THEN
                    IF {{schema}}.fire_deadline_timer(v_id, v_due, v_now, d->>'worker') THEN
                        PERFORM {{schema}}.interrupt_steps(
                            jsonb_build_object('instance', v_id, 'position', '$saga', 'command', v_due,
                                               'actor', v_actor),
                            jsonb_build_array(jsonb_build_object('position', v_pos,
                                                                 'step', d->'step_deadline'->>'step',
                                                                 'visit', (d->'step_deadline'->>'visit')::integer)),
                            v_now);
                    END IF;
                END IF;
                IF d->'step_deadline' ? 'late' THEN
                    -- The deadline has left the wait (here, by the timer's worker, or before): this command
                    -- comes after it, as one applied to a wait already left does (the settle of section 5).
                    v_side := d->'step_deadline'->'late';
                    UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL,
                        updated_at = v_now
                    WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token;
                    UPDATE {{schema}}.commands c SET state = v_side->>'state', last_error = v_side->>'reason',
                        claims = CASE WHEN v_side->>'state' = 'PARKED' THEN 0 ELSE c.claims END,
                        settled_at = CASE WHEN v_side->>'state' = 'PARKED' THEN NULL ELSE v_now END
                    WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE;
                    FOR x IN SELECT jsonb_array_elements(v_side->'history') LOOP
                        PERFORM {{schema}}.saga_history(v_id, x->>'kind', x->>'step', (x->>'visit')::integer, v_pos,
                                                        v_cmd, v_actor, NULLIF(x->'data', 'null'::jsonb), v_now);
                    END LOOP;
                END IF;
            END IF;
            RETURN;
        END IF;
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
    -- What the instance waits for is its positions' (the root's `wait`), not a copy here (migration 0032).
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
        -- Failed branches whose joins can still be met without them do not stop the instance (migration
        -- 0046). Asked only when a position has failed, so not on the way of an ordinary commit.
        IF v_status = 'FAILED' AND NOT {{schema}}.failures_stop(v_id) THEN
            v_status := (SELECT CASE WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END
                         FROM {{schema}}.positions p
                         WHERE p.instance_id = v_id AND p.status IN ('RUNNING', 'WAITING'));
        END IF;
    END IF;
    IF v_pstatus = 'FAILED' THEN
        -- This commit's failure stops the instance: the root's always; a branch's (IfStopped) when it is
        -- the one that stopped an instance not stopped before (a later one is passed over: one
        -- INSTANCE_FAILED, one error, one word to the parent), counted here, under the instance's lock.
        v_stops := NOT (d ? 'if_stopped') OR (v_before <> 'FAILED' AND v_status = 'FAILED');
    END IF;
    IF d ? 'if_stopped' THEN  -- a branch's failure: INSTANCE_FAILED (and the parent told), or BRANCH_FAILED
        v_side := d->'if_stopped'->(CASE WHEN v_stops THEN 'stopped' ELSE 'passed' END);
        v_history := COALESCE(v_history, '[]'::jsonb) || COALESCE(v_side->'history', '[]'::jsonb);
        v_nhist := jsonb_array_length(v_history);
        v_notify := COALESCE(v_notify, '[]'::jsonb) || COALESCE(v_side->'notify', '[]'::jsonb);
    END IF;
    UPDATE {{schema}}.instances i SET
        status = COALESCE(v_status, i.status),
        state = CASE WHEN v_state IS NOT NULL THEN v_state WHEN v_has_state THEN d->'state' ELSE i.state END,
        state_version = i.state_version + CASE WHEN v_has_state THEN 1 ELSE 0 END,
        error = CASE WHEN v_stops THEN v_move->'error' ELSE i.error END,
        step = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN v_move->>'step' ELSE i.step END,
        visit = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN (v_move->>'visit')::integer ELSE i.visit END,
        history_seq = i.history_seq + v_nhist,
        branches = v_branches,
        updated_at = v_now,
        ended_at = CASE WHEN v_end IS NOT NULL THEN v_now ELSE i.ended_at END
    WHERE i.id = v_id
    RETURNING i.state_version INTO v_version;

    -- 5. Settle the claimed command, fenced on the same token; or, for a continuation from a step's own
    -- command (START, STEP, RETRY), go on in that row, which keeps its kind (what began the run): one
    -- update of the row the worker holds, where a settle and an insert of the next step's command wrote
    -- two rows and six index entries (docs/performance.md, "The continuation in place"). What arrived
    -- from outside (a signal, a message, a timer, a child's or task's completion) stays settled as its
    -- own record, and so does a row whose payload this commit redacts. Fenced on the same token either way.
    IF v_follow IS NOT NULL AND NOT COALESCE(d->'ext' ? 'redacted_payloads', false) THEN
        -- No indexed column changes, so the update may be HOT: the lease expiry stays where the claim or
        -- the last renewal put it (the renewals move it on); the position's lease, moved above, is the
        -- one a claim of an expired lease goes by.
        UPDATE {{schema}}.commands c SET
            step = v_follow->>'step', visit = (v_follow->>'visit')::integer,
            payload = NULLIF(v_follow->'payload', 'null'::jsonb),
            attempt = 1, claims = 1, deferrals = 0, claimed_by = d->>'worker', last_error = NULL,
            created_at = v_now
        WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE
          AND c.kind IN ('START', 'STEP', 'RETRY')
        RETURNING c.id INTO v_next;
    END IF;
    -- A step's own command whose step ends in a timed wait on its position becomes the wait's timer
    -- (migration 0035): one update of the claimed row, where a settle and an insert wrote two rows, and a
    -- waiting instance keeps one command row, not two (docs/performance.md, "The timer in place"). The
    -- timer takes a fresh seq (it queues behind what arrived while the step ran, as an inserted one did)
    -- and every column an inserted timer sets; the token stays, so `settled_by` still tells a worker whose
    -- commit outcome was lost that its claim settled (until the timer's own claim replaces it). Not when
    -- the commit closes timers (it would close this one), ends the instance, or redacts the payload.
    IF v_next IS NULL AND v_follow IS NULL AND v_settle = 'COMPLETE' AND v_end IS NULL
       AND NOT COALESCE((d->>'close_timers')::boolean, false)
       AND NOT COALESCE(d->'ext' ? 'redacted_payloads', false) AND jsonb_array_length(v_commands) > 0 THEN
        -- The position's first new command, when it is a timer: its queue then orders as it did.
        SELECT x.ord - 1, x.c INTO v_timer_at, v_timer
        FROM jsonb_array_elements(v_commands) WITH ORDINALITY AS x(c, ord)
        WHERE COALESCE(x.c->>'position', v_pos) = v_pos
        ORDER BY x.ord LIMIT 1;
        IF v_timer->>'kind' = 'TIMER' THEN
            UPDATE {{schema}}.commands c SET
                seq = nextval('{{schema}}.command_seq'), kind = 'TIMER', state = 'PENDING',
                step = v_timer->>'step', visit = (v_timer->>'visit')::integer, name = v_timer->>'name',
                payload = NULLIF(v_timer->'payload', 'null'::jsonb), dedup_key = NULL, attempt = 1, claims = 0,
                deferrals = 0,
                available_at = COALESCE((v_timer->>'at')::timestamptz,
                                        v_now + make_interval(secs => COALESCE((v_timer->>'delay')::float8, 0))),
                claimed_by = NULL, last_error = NULL, created_at = v_now, settled_at = NULL, actor = NULL,
                context = NULL
            WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE
              AND c.kind IN ('START', 'STEP', 'RETRY')
            RETURNING c.id INTO v_in_place;
            IF v_in_place IS NOT NULL THEN
                v_commands := v_commands - v_timer_at;
            END IF;
        END IF;
    END IF;
    IF v_next IS NULL AND v_in_place IS NULL THEN
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
        -- IS TRUE: the lookup goes through the primary key, never a scan of a partial index (migration 0028).
        WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE
        RETURNING c.seq INTO v_cur_seq;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'stepstone: command % is not claimed under the token that holds instance % position %',
                v_cmd, v_id, v_pos USING ERRCODE = 'P0001';
        END IF;
        IF v_follow IS NOT NULL THEN
            v_commands := v_commands || jsonb_build_array(v_follow);  -- inserted below, already claimed
        END IF;
    END IF;

    -- 6. Other commands of this instance, in ascending id order.
    IF d ? 'queued' THEN
        -- Join reports queued behind the claimed one, carried out with it (SettleQueued, migration 0037);
        -- before the blocks below, which would reject them as leftovers of an instance this commit ends.
        UPDATE {{schema}}.commands c SET state = 'COMPLETE', settled_at = v_now, claimed_by = d->>'worker'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.id IN (SELECT jsonb_array_elements_text(d->'queued')::bigint)
                         AND x.instance_id = v_id AND x.position = v_pos
                         -- IS TRUE: by the primary key, never a scan of a partial index (migration 0028)
                         AND (x.state = 'PENDING') IS TRUE
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF (d->>'close_timers')::boolean THEN
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'WAIT_LEFT'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.position = v_pos AND x.kind = 'TIMER'
                         -- the queue index, by instance and position (migration 0028)
                         AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
                       ORDER BY x.id FOR UPDATE);
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
    IF jsonb_array_length(v_commands) > 0 THEN
        WITH ins AS (
            INSERT INTO {{schema}}.commands AS c
                (instance_id, definition, position, seq, kind, state, step, visit, name, payload, attempt,
                 claims, available_at, token, claimed_by, created_at)
            SELECT v_id, v_definition, COALESCE(x.c->>'position', v_pos),
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
            FROM jsonb_array_elements(v_commands) WITH ORDINALITY AS x(c, ord)
            ORDER BY x.ord
            RETURNING c.id, c.state
        )
        SELECT COALESCE((SELECT ins.id FROM ins WHERE ins.state = 'CLAIMED'), v_next) INTO v_next;
    END IF;

    -- 7. Child instances: started by this step, or told that this one ended.
    IF jsonb_array_length(d->'children') > 0 THEN
        PERFORM {{schema}}.start_children(v_id, v_pos, (v_move->>'visit')::integer, d->'children', v_now, v_actor);
    END IF;
    IF jsonb_array_length(v_notify) > 0 THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                         created_at)
        SELECT (n->>'parent_id')::uuid, n->>'position', nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION',
               'PENDING', (n->>'visit')::integer, n->'payload', v_now, v_now
        FROM jsonb_array_elements(v_notify) AS n;
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
        FROM jsonb_array_elements(v_history) WITH ORDINALITY AS x(h, ord);
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
                     -- the queue index, by instance and position (migration 0028)
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
                     AND x.available_at <= v_now) THEN
            PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                               WHERE c.oid = '{{schema}}.commands'::regclass),
                              (extract(epoch FROM v_now) * 1000)::bigint::text || ':' || v_definition);
        END IF;
    END IF;

    -- A decision that wrote no state, made on a version another position has moved on since: the worker
    -- goes on from the current state, not the one it claimed (migration 0037). Else a join that fires
    -- while a branch commits would hand its next step the state from before that branch's change, under
    -- the new version, and the step's commit would write over the change.
    IF NOT v_has_state AND v_version <> (d->>'state_version')::bigint THEN
        v_state := (SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id);
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

-- ==== version 6 (migration 0006_sagas) ====
-- Sagas: compensation, deadlines, and cancellation that settles everything (core/saga.py).
--
-- A step that declares a compensation leaves a row in `compensations` when it completes (section
-- 'compensable', rank 10): what it recorded, in the order of completion (the id: commits of one
-- instance serialize on its row). A saga runs on a position of its own, '$saga', beside the root and
-- the branches: its deadline timer and its COMPENSATE commands queue there, so a busy root position
-- never holds them up. Section 'saga' (rank 11) begins a saga (closing every other position, taking
-- their leases so a running handler's commit is refused, settling their open commands and children),
-- queues the next compensation (the latest PENDING row), and ends the instance when none is left:
-- COMPENSATED after a failure, CANCELLED after a cancel, TIMED_OUT after the deadline. A compensation
-- given up makes the instance COMPENSATION_FAILED; retry resumes it where it stopped.
--
-- Lock order inside a saga function: the instance row (taken by its caller) -> positions (ascending
-- path) -> commands (ascending id) -> child instances (ascending id) -> compensations -> history.

ALTER TABLE {{schema}}.instances ADD COLUMN deadline_at timestamptz;
-- Why and when the saga began ({cause, reason, actor, at}); NULL while the instance never compensated.
ALTER TABLE {{schema}}.instances ADD COLUMN saga jsonb;

CREATE TABLE {{schema}}.compensations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    instance_id uuid NOT NULL,
    position text NOT NULL,
    step text NOT NULL,
    visit integer NOT NULL,
    recorded jsonb,
    -- PENDING (to undo), COMPENSATED, FAILED (given up; an operator's retry makes it PENDING again)
    status text NOT NULL DEFAULT 'PENDING',
    attempts integer NOT NULL DEFAULT 0,
    last_error jsonb,
    completed_at timestamptz NOT NULL,
    compensated_at timestamptz
);
CREATE INDEX compensations_instance ON {{schema}}.compensations (instance_id, id);

-- Once a saga has begun, only the saga decides the instance's status: a late command on a closed
-- position (a signal sent meanwhile, say) commits a status derived from positions, which must not
-- undo it. The saga's own writes go to COMPENSATING or COMPENSATION_FAILED, or end the instance
-- (setting ended_at); nothing changes the status of an instance that has ended.
CREATE FUNCTION {{schema}}.keep_saga_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.ended_at IS NULL AND (NEW.status IN ('COMPENSATING', 'COMPENSATION_FAILED')
                                 OR NEW.ended_at IS DISTINCT FROM OLD.ended_at) THEN
        RETURN NEW;
    END IF;
    NEW.status := OLD.status;
    RETURN NEW;
END $$;

CREATE TRIGGER instances_keep_saga_status
    BEFORE UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (OLD.saga IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.keep_saga_status();

-- wait_for returns on these too.
CREATE TRIGGER instances_notify_saga_settled
    AFTER UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (NEW.status IN ('COMPENSATED', 'TIMED_OUT', 'COMPENSATION_FAILED')
                       AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.notify_settled();

-- The saga's own position: its deadline timers and its compensations queue there.
CREATE FUNCTION {{schema}}.open_saga_position(p_instance uuid, p_now timestamptz)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {{schema}}.positions (instance_id, path, status, visit, created_at, updated_at)
    VALUES (p_instance, '$saga', 'SAGA', 1, p_now, p_now)
    ON CONFLICT (instance_id, path) DO NOTHING;
$$;

-- One history entry written by a saga function, after whatever the commit itself records.
CREATE FUNCTION {{schema}}.saga_history(p_instance uuid, p_kind text, p_step text, p_visit integer,
                                        p_position text, p_command bigint, p_actor text, p_data jsonb,
                                        p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
BEGIN
    UPDATE {{schema}}.instances i SET history_seq = i.history_seq + 1 WHERE i.id = p_instance
    RETURNING i.history_seq INTO v_seq;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
    VALUES (p_instance, v_seq, p_now, p_kind, p_step, p_visit, p_command, p_actor, p_data, p_position);
END $$;

-- Settle every open command of an instance (PENDING, DEFERRED, CLAIMED, PARKED, DEAD) as CANCELLED,
-- in ascending id order, with one COMMAND_CANCELLED history entry each naming who and why. Timers
-- are commands, so they are finished here too. `p_position` and `p_kinds` narrow it to one position's
-- commands of those kinds (a step deadline); `p_code` starts each command's last_error. Returns how
-- many it settled.
CREATE FUNCTION {{schema}}.settle_open_commands(p_instance uuid, p_reason text, p_actor text, p_now timestamptz,
                                                p_position text DEFAULT NULL, p_kinds text[] DEFAULT NULL,
                                                p_code text DEFAULT 'INSTANCE_CANCELLED')
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
    v_n integer;
BEGIN
    SELECT i.history_seq INTO v_seq FROM {{schema}}.instances i WHERE i.id = p_instance;
    WITH locked AS (
        SELECT x.id, x.state FROM {{schema}}.commands x
        WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
          AND (p_position IS NULL OR x.position = p_position) AND (p_kinds IS NULL OR x.kind = ANY (p_kinds))
        ORDER BY x.id FOR UPDATE
    ), settled AS (
        UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = p_now,
            last_error = p_code || ': ' || c.kind
        FROM locked WHERE c.id = locked.id
        RETURNING c.id, c.kind, c.name, c.position, c.step, c.visit, locked.state AS was
    )
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
    SELECT p_instance, v_seq + (row_number() OVER (ORDER BY s.id))::integer, p_now, 'COMMAND_CANCELLED', s.step,
           s.visit, s.id, p_actor,
           jsonb_strip_nulls(jsonb_build_object('command', s.id, 'kind', s.kind, 'name', left(s.name, 128),
                                                'was', s.was, 'reason', p_reason)),
           s.position
    FROM settled s;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.instances i SET history_seq = i.history_seq + v_n WHERE i.id = p_instance;
    RETURN v_n;
END $$;

-- Close an instance's positions and take their leases, so a handler still running there commits
-- nothing; `p_keep` (the position whose commit this is) keeps its lease. For a saga (`p_saga`), a
-- FAILED position stays FAILED (it shows where it failed) and '$saga' stays open.
CREATE FUNCTION {{schema}}.close_positions(p_instance uuid, p_now timestamptz, p_keep text, p_saga boolean)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {{schema}}.positions p SET
        status = CASE WHEN p.status IN ('COMPLETED', 'CANCELLED') THEN p.status
                      WHEN p_saga AND (p.path = '$saga' OR p.status = 'FAILED') THEN p.status
                      ELSE 'CANCELLED' END,
        lease_token = CASE WHEN p.path = p_keep THEN p.lease_token END,
        lease_until = CASE WHEN p.path = p_keep THEN p.lease_until END,
        lease_owner = CASE WHEN p.path = p_keep THEN p.lease_owner END,
        updated_at = p_now
    WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                      WHERE x.instance_id = p_instance ORDER BY x.path FOR UPDATE);
END $$;

-- The children that go with their parent (cancel_with_parent), cancelled in ascending id order.
CREATE FUNCTION {{schema}}.cancel_children(p_instance uuid, p_reason text, p_actor text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_child uuid;
BEGIN
    FOR v_child IN SELECT i.id FROM {{schema}}.instances i
                   WHERE i.parent_id = p_instance AND i.cancel_with_parent
                     AND i.status NOT IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT') ORDER BY i.id LOOP
        PERFORM {{schema}}.cancel_tree(v_child, p_reason, p_actor, false);
    END LOOP;
END $$;

CREATE FUNCTION {{schema}}.tell_parent(p_child {{schema}}.instances, p_status text, p_message text,
                                                  p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_for_saga boolean := coalesce(p_child.saga ? 'record', false);
BEGIN
    IF p_child.parent_id IS NULL THEN
        RETURN;
    END IF;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                     created_at)
    VALUES (p_child.parent_id, CASE WHEN v_for_saga THEN '$saga' ELSE COALESCE(p_child.parent_position, '') END,
            nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION', 'PENDING',
            CASE WHEN v_for_saga THEN 1 ELSE p_child.parent_visit END,
            jsonb_build_object('child_id', p_child.id, 'status', p_status,
                               'error', jsonb_build_object('type', initcap(p_status), 'message', p_message))
            || CASE WHEN v_for_saga THEN (SELECT jsonb_build_object('record', k.id, 'step', k.step, 'visit', k.visit)
                                          FROM {{schema}}.compensations k
                                          WHERE k.id = (p_child.saga->>'record')::bigint)
                    ELSE '{}'::jsonb END,
            p_now, p_now);
END $$;

-- cancel_tree changes here; its one definition is in the version 2 section.

-- The history entry that ends a saga (INSTANCE_COMPENSATED, _CANCELLED, _TIMED_OUT) lists what this
-- round compensated. It listed every compensation the instance ever made: a saga replayed after it had
-- compensated, that compensated again, named the steps of the first round too. A round begins at
-- saga->'at' (saga_begin); a round resumed by a retry keeps it.
CREATE FUNCTION {{schema}}.saga_next(p_instance uuid, p_now timestamptz, p_actor text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_inst {{schema}}.instances%ROWTYPE;
    v_rec {{schema}}.compensations%ROWTYPE;
    v_final text;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance;
    SELECT * INTO v_rec FROM {{schema}}.compensations k
    WHERE k.instance_id = p_instance AND k.status = 'PENDING' ORDER BY k.id DESC LIMIT 1 FOR UPDATE;
    IF FOUND THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, payload,
                                         available_at, created_at)
        VALUES (p_instance, '$saga', nextval('{{schema}}.command_seq'), 'COMPENSATE', 'PENDING', v_rec.step,
                v_rec.visit, jsonb_build_object('record', v_rec.id, 'step', v_rec.step, 'position', v_rec.position,
                                                'visit', v_rec.visit, 'recorded', v_rec.recorded,
                                                'cause', v_inst.saga->>'cause'),
                p_now, p_now);
        UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = p_instance;
        RETURN 'COMPENSATING';
    END IF;
    -- By why it compensated: a failure (or a parent's saga) undone, a cancel, a deadline.
    v_final := CASE v_inst.saga->>'cause' WHEN 'cancelled' THEN 'CANCELLED' WHEN 'timed_out' THEN 'TIMED_OUT'
                                          ELSE 'COMPENSATED' END;
    UPDATE {{schema}}.positions p SET status = 'COMPLETED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = p_now
    WHERE p.instance_id = p_instance AND p.path = '$saga';
    UPDATE {{schema}}.commands c SET state = 'REJECTED', token = NULL, settled_at = p_now,
        last_error = 'INSTANCE_ENDED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET status = v_final, wait = NULL, updated_at = p_now, ended_at = p_now
    WHERE i.id = p_instance;
    PERFORM {{schema}}.saga_history(
        p_instance, 'INSTANCE_' || v_final, NULL, NULL, NULL, NULL, p_actor,
        jsonb_build_object('cause', v_inst.saga->>'cause',
                           'compensated', (SELECT coalesce(jsonb_agg(k.step ORDER BY k.compensated_at, k.id), '[]')
                                           FROM {{schema}}.compensations k
                                           WHERE k.instance_id = p_instance AND k.status = 'COMPENSATED'
                                             AND k.compensated_at >= COALESCE((v_inst.saga->>'at')::timestamptz,
                                                                              '-infinity'))),
        p_now);
    -- A child that timed out or was cancelled tells its parent (a failure told it when the step failed),
    -- and so does a child its parent's saga waits on.
    IF v_inst.saga->>'cause' <> 'failed' OR v_inst.saga ? 'record' THEN
        PERFORM {{schema}}.tell_parent(v_inst, v_final, coalesce(v_inst.saga->>'reason', v_final), p_now);
    END IF;
    RETURN v_final;
END $$;

CREATE FUNCTION {{schema}}.saga_begin(p_instance uuid, p_cause text, p_reason text, p_actor text,
                                                 p_now timestamptz, p_keep text, p_record bigint DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    -- The children it takes over, first, while the positions still wait (record_open_children, version 90).
    PERFORM {{schema}}.record_open_children(p_instance, p_now);
    PERFORM {{schema}}.close_positions(p_instance, p_now, p_keep, true);
    PERFORM {{schema}}.open_saga_position(p_instance, p_now);
    PERFORM {{schema}}.settle_open_commands(p_instance, coalesce(p_reason, 'compensating: ' || p_cause), p_actor,
                                            p_now);
    -- (A completed child its parent compensates is reopened: ended_at is cleared.)
    UPDATE {{schema}}.instances i SET branches = 0, wait = NULL, updated_at = p_now, ended_at = NULL,
        saga = jsonb_strip_nulls(jsonb_build_object('cause', p_cause, 'reason', p_reason, 'actor', p_actor,
                                                    'at', p_now, 'record', p_record))
    WHERE i.id = p_instance;
    -- A step whose compensation an earlier round gave up (then a replay went on) is still not undone.
    PERFORM {{schema}}.saga_owe_given_up(p_instance);
    RETURN {{schema}}.saga_next(p_instance, p_now, p_actor);
END $$;

CREATE FUNCTION {{schema}}.compensate_child(p_child uuid, p_record bigint, p_actor text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_child {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_child FROM {{schema}}.instances i WHERE i.id = p_child FOR UPDATE;
    IF v_child.status IN ('COMPLETED', 'PENDING', 'RUNNING', 'WAITING', 'FAILED') THEN
        -- Completed, or still open: cancel with compensation (a running handler's commit is refused).
        PERFORM {{schema}}.saga_begin(p_child, 'parent', 'the parent compensates', p_actor, p_now, NULL, p_record);
    ELSIF v_child.status = 'COMPENSATING' THEN
        -- It compensates on its own already: it reports to this saga when it ends.
        UPDATE {{schema}}.instances i SET saga = (i.saga - 'parent_replayed') || jsonb_build_object('record', p_record)
        WHERE i.id = p_child;
    ELSIF v_child.status = 'COMPENSATION_FAILED' THEN
        -- (A link a replay of this parent settled, replay_instance, is made again: this round asks.)
        UPDATE {{schema}}.instances i SET saga = (i.saga - 'parent_replayed') || jsonb_build_object('record', p_record),
            error = NULL
        WHERE i.id = p_child;
        UPDATE {{schema}}.positions p SET status = 'SAGA' WHERE p.instance_id = p_child AND p.path = '$saga';
        PERFORM {{schema}}.saga_owe_given_up(p_child);
        PERFORM {{schema}}.saga_next(p_child, p_now, p_actor);
    ELSE
        v_child.saga := jsonb_build_object('cause', 'parent', 'record', p_record);
        PERFORM {{schema}}.tell_parent(v_child, COALESCE(v_child.status, 'MISSING'), 'the child had ended', p_now);
    END IF;
END $$;

-- Section 'compensable': remember the compensable steps this commit completed.
CREATE FUNCTION {{schema}}.record_compensable(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT (p_commit->>'instance')::uuid, p_commit->>'position', x.c->>'step', (x.c->>'visit')::integer,
           NULLIF(x.c->'recorded', 'null'::jsonb), p_now
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(c, ord)
    ORDER BY x.ord;
END $$;

-- A saga stopped at COMPENSATION_FAILED says in its error which step's compensation gave up and why.
-- The error held the compensation record's id and, nested, the last error, with no `message` and no
-- `step`: `stepstone show` printed "CompensationFailed:" and nothing else. advance_saga now adds both
-- (the fields it had are kept).
CREATE FUNCTION {{schema}}.advance_saga(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    v_actor text := p_commit->>'actor';
    v_step text;
    x jsonb;
BEGIN
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        IF x->>'op' = 'begin' THEN
            PERFORM {{schema}}.saga_begin(v_id, x->>'cause', NULL, v_actor, p_now, p_commit->>'position');
            CONTINUE;
        ELSIF x->>'op' = 'compensate_child' THEN
            PERFORM {{schema}}.compensate_child((x->>'child')::uuid, (x->>'record')::bigint, v_actor, p_now);
            UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = v_id;
            CONTINUE;
        END IF;
        UPDATE {{schema}}.compensations k SET
            attempts = k.attempts + 1,
            status = CASE x->>'op' WHEN 'done' THEN 'COMPENSATED' WHEN 'exhausted' THEN 'FAILED' ELSE k.status END,
            last_error = CASE WHEN x->>'op' = 'done' THEN k.last_error ELSE x->'error' END,
            compensated_at = CASE WHEN x->>'op' = 'done' THEN p_now END
        WHERE k.id = (x->>'record')::bigint AND k.instance_id = v_id AND k.status = 'PENDING'
        RETURNING k.step INTO v_step;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'stepstone: compensation % of instance % is not pending', x->>'record', v_id
                USING ERRCODE = 'P0001';
        END IF;
        IF x->>'op' = 'done' THEN
            PERFORM {{schema}}.saga_next(v_id, p_now, v_actor);
        ELSIF x->>'op' = 'exhausted' THEN
            UPDATE {{schema}}.instances i SET status = 'COMPENSATION_FAILED', updated_at = p_now,
                error = jsonb_build_object(
                    'type', 'CompensationFailed', 'step', v_step,
                    'message', format('the compensation of step %L gave up after %s attempt%s: %s: %s', v_step,
                                      x->>'attempts', CASE WHEN x->>'attempts' = '1' THEN '' ELSE 's' END,
                                      x->'error'->>'type', x->'error'->>'message'),
                    'record', (x->>'record')::bigint, 'error', x->'error', 'attempts', (x->>'attempts')::integer)
            WHERE i.id = v_id;
            IF (SELECT i.saga ? 'record' FROM {{schema}}.instances i WHERE i.id = v_id) THEN
                PERFORM {{schema}}.tell_parent(i, 'COMPENSATION_FAILED', x->'error'->>'message', p_now)
                FROM {{schema}}.instances i WHERE i.id = v_id;
            END IF;
        ELSE
            UPDATE {{schema}}.instances i SET status = 'COMPENSATING', updated_at = p_now WHERE i.id = v_id;
        END IF;
    END LOOP;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('compensable', 10, 'record_compensable'), ('saga', 11, 'advance_saga');

-- cancel(compensate): compensate first, then CANCELLED. Outcomes: not_found; unchanged (already
-- ended, or already compensating when asked to compensate); cancelled; compensating.
CREATE FUNCTION {{schema}}.cancel_saga(p_instance uuid, p_reason text, p_actor text, p_compensate boolean)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_before text;
    v_after text;
BEGIN
    SELECT i.status INTO v_before FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    IF v_before IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT')
       OR (p_compensate AND v_before IN ('COMPENSATING', 'COMPENSATION_FAILED')) THEN
        RETURN QUERY SELECT 'unchanged', v_before;
        RETURN;
    END IF;
    IF NOT p_compensate THEN
        RETURN QUERY SELECT 'cancelled', {{schema}}.cancel_tree(p_instance, p_reason, p_actor, true);
        RETURN;
    END IF;
    PERFORM {{schema}}.saga_history(p_instance, 'CANCEL_REQUESTED', NULL, NULL, NULL, NULL, p_actor,
                                    jsonb_build_object('reason', p_reason, 'compensate', true,
                                                       'status_before', v_before), v_now);
    v_after := {{schema}}.saga_begin(p_instance, 'cancelled', p_reason, p_actor, v_now, NULL);
    RETURN QUERY SELECT 'compensating', v_after;
END $$;

-- Retry: a COMPENSATION_FAILED instance resumes its compensation at the one given up (from its first
-- attempt); anything else goes to retry_instance. A child whose compensation its parent's saga asked for,
-- and whose parent a replay has taken forward since (replay_instance marks it `parent_replayed`), is
-- refused (outcome parent_went_on): its compensation would undo it under a parent that goes on with it.
CREATE FUNCTION {{schema}}.retry_saga(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF FOUND AND v_inst.status = 'COMPENSATION_FAILED' AND v_inst.saga ? 'parent_replayed' THEN
        RETURN QUERY SELECT 'parent_went_on', v_inst.status;
        RETURN;
    END IF;
    IF FOUND AND v_inst.status = 'COMPENSATION_FAILED' THEN
        UPDATE {{schema}}.positions p SET status = 'SAGA', lease_token = NULL, lease_until = NULL,
            lease_owner = NULL, updated_at = v_now
        WHERE p.instance_id = p_instance AND p.path = '$saga';
        PERFORM {{schema}}.saga_owe_given_up(p_instance);
        UPDATE {{schema}}.instances i SET error = NULL WHERE i.id = p_instance;
        PERFORM {{schema}}.saga_history(p_instance, 'INSTANCE_RETRIED', NULL, NULL, NULL, NULL, p_actor,
                                        jsonb_build_object('error', v_inst.error, 'compensation', true), v_now);
        RETURN QUERY SELECT 'retried', {{schema}}.saga_next(p_instance, v_now, p_actor);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM {{schema}}.retry_instance(p_instance, p_actor);
END $$;

-- An instance deadline: a TIMER 'deadline' on '$saga', in the start's own statement.
CREATE FUNCTION {{schema}}.schedule_deadline(p_instance uuid, p_at timestamptz, p_seconds float8)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_at timestamptz := COALESCE(p_at, v_now + make_interval(secs => p_seconds));
BEGIN
    IF p_instance IS NULL OR (p_at IS NULL AND p_seconds IS NULL) THEN
        RETURN p_instance;
    END IF;
    v_at := GREATEST(v_at, v_now);
    PERFORM {{schema}}.open_saga_position(p_instance, v_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, name, visit, available_at, created_at)
    VALUES (p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', 'deadline', 1, v_at, v_now);
    UPDATE {{schema}}.instances i SET deadline_at = v_at WHERE i.id = p_instance;
    RETURN p_instance;
END $$;

-- Step deadlines on the first step of a fork's branches, which the fork schedules: why, the migration's
-- header.
CREATE FUNCTION {{schema}}.schedule_step_deadlines(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
BEGIN
    PERFORM {{schema}}.open_saga_position(v_id, p_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     available_at, created_at)
    SELECT v_id, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', x->>'step', t.visit,
           'step_deadline', jsonb_build_object('position', t.path, 'step', x->>'step', 'visit', t.visit),
           p_now + make_interval(secs => (x->>'seconds')::float8), p_now
    FROM jsonb_array_elements(p_items) AS x
    CROSS JOIN LATERAL (
        -- A branch the commit opened: the visit open_branches gave it (1, or the next on a fork's rerun).
        SELECT COALESCE(x->>'position', p_commit->>'position') AS path,
               COALESCE((x->>'visit')::integer,
                        (SELECT p.visit FROM {{schema}}.positions p
                         WHERE p.instance_id = v_id AND p.path = x->>'position' AND p.step = x->>'step'
                           AND p.status = 'RUNNING')) AS visit
    ) AS t
    WHERE t.visit IS NOT NULL
      -- One timer a step visit: a retry of a wait or timer failed at its deadline queues its deadline anew,
      -- and its RETRY, entering the step again at that visit, asked for it again (version 91).
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.commands y
                      WHERE y.instance_id = v_id AND y.position = '$saga' AND y.kind = 'TIMER'
                        AND y.name = 'step_deadline' AND y.step = x->>'step' AND y.visit = t.visit
                        AND y.payload->>'position' = t.path
                        AND (y.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE);
END $$;

-- Step deadlines on waits and timers too, and on the start step. A position interrupted at a wait or
-- a timer is left by its TIMER 'step_deadline' like a running one (core/saga.py). STEP_DEADLINE_PASSED
-- is recorded only for a position interrupted (migration 0056).
CREATE FUNCTION {{schema}}.interrupt_steps(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p_commit->>'instance')::uuid;
    x jsonb;
BEGIN
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL,
            updated_at = p_now
        WHERE p.instance_id = v_id AND p.path = x->>'position' AND p.step = x->>'step'
          AND p.visit = (x->>'visit')::integer AND p.status IN ('RUNNING', 'WAITING');
        IF NOT FOUND THEN
            CONTINUE;  -- the step finished (or the position moved on) in time: nothing to record
        END IF;
        -- Written here, where the interrupt applies, not by the core, which cannot know (migration 0056).
        PERFORM {{schema}}.saga_history(v_id, 'STEP_DEADLINE_PASSED', x->>'step', (x->>'visit')::integer,
                                        p_commit->>'position', (p_commit->>'command')::bigint, p_commit->>'actor',
                                        jsonb_build_object('position', x->>'position'), p_now);
        PERFORM {{schema}}.settle_open_commands(v_id, 'step deadline', p_commit->>'actor', p_now, x->>'position',
                                                ARRAY['START', 'STEP', 'RETRY'], 'STEP_DEADLINE');
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, available_at,
                                         created_at)
        VALUES (v_id, x->>'position', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', x->>'step',
                (x->>'visit')::integer, 'step_deadline', p_now, p_now);
    END LOOP;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('step_deadlines', 12, 'schedule_step_deadlines'),
                                              ('interrupts', 13, 'interrupt_steps');

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
-- -> a message id's advisory lock (migration 0068) -> the correlation key's advisory lock (by ascending
-- name, key) -> subscriptions -> messages -> tasks -> dedup -> history -> outbox. A publisher takes its
-- message id's lock, then the rows of the instances its key's open subscriptions name (waiting, ascending id;
-- migration 0075), then the key's lock; an instance whose subscription opened in between it takes with
-- NOWAIT (a busy instance fails the attempt, 55P03, and the client tries again), so it never waits on an
-- instance while holding a key.
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
    k record;
BEGIN
    -- Every correlation key the commit takes, in one (name, key) order, before any: its subscriptions' and
    -- those of the buffered messages it settled untaken before this section (the join's losers, its own
    -- command, the other commands: stepstone.returned_messages), which commit_decisions hands on at its end
    -- (version 77) under those keys again. Taken there, after these, the two sorted batches crossed: a commit
    -- subscribing k2 and handing k1 on held k2 while it waited for k1, and one subscribing k1 and handing
    -- k2 on held k1 while it waited for k2 (migration 0079).
    FOR k IN SELECT nm AS name, it->>'key' AS key
             FROM jsonb_array_elements(p_items) AS it, jsonb_array_elements_text(it->'names') AS nm
             UNION
             SELECT c.name, c.payload->>'correlation_key' FROM {{schema}}.commands c
             WHERE c.id = ANY (string_to_array(NULLIF(current_setting('stepstone.returned_messages', true), ''),
                                               ',')::bigint[])
             ORDER BY 1, 2 LOOP
        PERFORM {{schema}}.lock_correlation(k.name, k.key);
    END LOOP;
    FOR x IN SELECT jsonb_array_elements(p_items) LOOP
        v_visit := (x->>'visit')::integer;
        v_key := x->>'key';
        v_names := ARRAY(SELECT n FROM jsonb_array_elements_text(x->'names') AS n ORDER BY n);
        PERFORM {{schema}}.lock_correlation(n, v_key) FROM unnest(v_names) AS n ORDER BY n;  -- (held already)
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

-- The open-signal cap: an instance holds at most `stepstone.max_open_signals` (a setting, default
-- 1000) open signals and messages (PENDING, DEFERRED or PARKED). One more is refused with SQLSTATE
-- SC429, which aborts the whole statement: a refused signal leaves no command and no dedup row.
CREATE FUNCTION {{schema}}.max_open_signals() RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT COALESCE(NULLIF(current_setting('stepstone.max_open_signals', true), '')::integer, 1000)
$$;

-- A signal, message or task completion recorded for a position (one trigger, so a signal pays one call):
-- * past the cap it is refused (signals and messages only; not a buffered message the commit entering
--   its wait takes: it arrived when it was published, migration 0068);
-- * the timers it must not lose to move behind it in the position's queue: a wait's timeout not yet
--   due (a signal or message recorded before the timeout's fire time wins), and every pending timer
--   of a task (its due date, reminder and expiry wait while the completion is pending);
-- * behind another signal, message or task completion still open on its position it waits off the ready
--   walk (version 72, below): available a minute on, and sooner when the one ahead leaves the queue.
CREATE FUNCTION {{schema}}.command_recorded() RETURNS trigger
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

CREATE TRIGGER commands_recorded
    BEFORE INSERT ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION') AND NEW.state = 'PENDING')
    EXECUTE FUNCTION {{schema}}.command_recorded();

-- A cancelled position (the instance cancelled, a join's losers) cancels its open tasks, human and
-- external, and closes its subscriptions (migration 0049: external tasks too).
CREATE FUNCTION {{schema}}.close_position_waits() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    UPDATE {{schema}}.tasks k SET status = 'CANCELLED', ended_at = v_now, updated_at = v_now
    WHERE k.instance_id = NEW.instance_id AND k.position = NEW.path AND k.status IN ('OPEN', 'COMPLETING');
    UPDATE {{schema}}.external_tasks x SET status = 'CANCELLED', last_error = 'NOT_AWAITED', updated_at = v_now,
        ended_at = v_now
    WHERE x.instance_id = NEW.instance_id AND x.position = NEW.path AND x.status = 'OPEN';
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
-- A completion's key (TASK_COMPLETE) whose completion was handed back (the task no longer holds the command
-- the key recorded: given back OPEN by a refusal or a retry, and perhaps taken by another completion since)
-- is NULL for the same request: its repeat is a new request, not the earlier answer (version 88).
CREATE FUNCTION {{schema}}.task_key_seen(p_kind text, p_task uuid, p_key text, p_fingerprint text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN x.fingerprint <> p_fingerprint THEN 'conflict'
                WHEN x.kind = 'TASK_COMPLETE'
                     AND NOT EXISTS (SELECT 1 FROM {{schema}}.tasks k
                                     WHERE k.id = p_task AND k.completion_command::text = x.target) THEN NULL
                ELSE 'duplicate' END
    FROM {{schema}}.dedup x WHERE x.kind = p_kind AND x.namespace = p_task::text AND x.key = p_key
$$;

CREATE FUNCTION {{schema}}.task_assign(p_task uuid, p_op text, p_to text, p_actor text,
                                                  p_groups text[], p_force boolean, p_reason text,
                                                  p_key text, p_fingerprint text)
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
        -- To the user who holds it already: nothing moves, so nothing is recorded (as claiming one's
        -- own task); a retried reassign or delegate whose reply was lost gets the task as it is.
        IF p_to = v_task.assignee THEN
            RETURN QUERY SELECT 'unchanged', to_jsonb(v_task);
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
-- task as it is now, while it holds that key's completion; one handed back is reserved again), conflict (the same key, other content), not_found, not_open (COMPLETING,
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
    -- A key whose completion was handed back (task_key_seen) now names this one (version 88).
    IF p_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('TASK_COMPLETE', p_task::text, p_key, p_fingerprint, v_cmd::text, v_now)
        ON CONFLICT (kind, namespace, key) DO UPDATE SET target = EXCLUDED.target, created_at = EXCLUDED.created_at;
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

-- start_or_signal changes here; its one definition is in the version 21 section.

-- ==== version 8 (migration 0008_registry) ====
-- The definitions registry: versions and their lifecycle, scopes and activations, pin admission,
-- what each live worker serves (for the stranded-instance report) and in-flight migration.
--
-- A definition row is (scope, definition_id, version): kind CODE (recorded by workers at start-up)
-- or DOCUMENT (YAML/JSON text with its SHA-256 digest), status
--     CANDIDATE -> PUBLISHING -> AVAILABLE <-> DEPRECATED -> RETIRED (-> AVAILABLE: reinstatement)
-- Every lifecycle change takes the definition id's advisory lock (define_lock below) exclusively;
-- pin admission takes it shared, so starts never serialize each other but a deprecation waits for
-- the starts already admitting.
-- Lock order (adds to the one in the version 2 section): a lifecycle change takes the definition id's
-- advisory lock, then the id's definition rows, then activations, and never an instance row. Pin
-- admission takes the advisory lock shared from inside a statement that may already hold instance rows
-- (a migration: instance -> positions -> commands -> history); no lifecycle transaction waits for an
-- instance row, so the two cannot deadlock.
ALTER TABLE {{schema}}.definitions
    ADD COLUMN kind text NOT NULL DEFAULT 'CODE',
    ADD COLUMN status text NOT NULL DEFAULT 'AVAILABLE',
    ADD COLUMN state_model text,
    ADD COLUMN signal_names jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN message_names jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN input_schema jsonb,
    ADD COLUMN document text,
    ADD COLUMN document_format text,
    ADD COLUMN document_digest text,
    ADD COLUMN publish_token uuid,
    ADD COLUMN publish_claimed_at timestamptz,
    ADD COLUMN status_changed_at timestamptz,
    ADD CONSTRAINT definitions_kind CHECK (kind IN ('CODE', 'DOCUMENT')),
    ADD CONSTRAINT definitions_status
        CHECK (status IN ('CANDIDATE', 'PUBLISHING', 'AVAILABLE', 'DEPRECATED', 'RETIRED')),
    ADD CONSTRAINT definitions_document
        CHECK ((kind = 'DOCUMENT') = (document IS NOT NULL) AND (document IS NULL) = (document_digest IS NULL)),
    ADD CONSTRAINT definitions_publishing CHECK ((status = 'PUBLISHING') = (publish_token IS NOT NULL));

-- Each scope's current version of a definition id. No row: the scope follows the default scope.
CREATE TABLE {{schema}}.definition_activations (
    scope text NOT NULL,
    definition_id text NOT NULL,
    target_scope text NOT NULL,
    version integer NOT NULL,
    activated_at timestamptz NOT NULL,
    activated_by text,
    PRIMARY KEY (scope, definition_id),
    CONSTRAINT activations_target CHECK (target_scope = scope OR target_scope = 'default'),
    CONSTRAINT activations_definition FOREIGN KEY (target_scope, definition_id, version)
        REFERENCES {{schema}}.definitions (scope, definition_id, version) ON DELETE RESTRICT
);

-- What each worker serves, refreshed by its heartbeat: the stranded report joins instances to it.
CREATE TABLE {{schema}}.worker_plans (
    worker_id text NOT NULL,
    scope text NOT NULL,
    definition_id text NOT NULL,
    version integer NOT NULL,
    plan_hash text NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    PRIMARY KEY (worker_id, definition_id, version, scope)
);
CREATE INDEX worker_plans_pin ON {{schema}}.worker_plans (definition_id, version, plan_hash, seen_at);

-- The instance's scope column is its scope key (tenant); definition_scope is the scope of the
-- definition row it is pinned to (its own scope's row of that version when there is one, else the
-- default scope's), set by pin admission.
ALTER TABLE {{schema}}.instances ADD COLUMN definition_scope text NOT NULL DEFAULT 'default';
CREATE INDEX instances_scope_created ON {{schema}}.instances (scope, created_at, id);

-- The one advisory lock of a definition id (two int4 keys: a namespace and the id's hash).
CREATE FUNCTION {{schema}}.define_lock_key(p_definition text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext('stepstone.definition:' || p_definition) $$;

-- The trigger keeps its behaviour and now calls the one check.
CREATE FUNCTION {{schema}}.admit_pin() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.definition_id = OLD.definition_id AND NEW.version = OLD.version
       AND NEW.plan_hash = OLD.plan_hash AND NEW.scope = OLD.scope THEN
        RETURN NEW;
    END IF;
    NEW.definition_scope := COALESCE({{schema}}.admitted_scope(NEW.definition_id, NEW.version, NEW.plan_hash,
                                                               NEW.scope), NEW.definition_scope);
    RETURN NEW;
END $$;

CREATE TRIGGER instances_admit_pin
    BEFORE INSERT OR UPDATE OF definition_id, version, plan_hash, scope ON {{schema}}.instances
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.admit_pin();

-- signal_position changes here; its one definition is in the version 2 section.

CREATE FUNCTION {{schema}}.migrate_instance(
    p_instance uuid, p_from_version integer, p_from_hash text, p_state_version bigint,
    p_to_version integer, p_to_hash text, p_step_map jsonb, p_positions jsonb, p_state jsonb, p_actor text)
RETURNS TABLE (outcome text, command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_id bigint;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.version = p_to_version AND v_inst.plan_hash = p_to_hash THEN
        RETURN QUERY SELECT 'already', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.version <> p_from_version OR v_inst.plan_hash <> p_from_hash
       OR v_inst.state_version <> p_state_version THEN
        RETURN QUERY SELECT 'changed', NULL::bigint;
        RETURN;
    END IF;
    IF {{schema}}.is_terminal(v_inst.status) THEN
        RETURN QUERY SELECT 'ended', NULL::bigint;
        RETURN;
    END IF;
    PERFORM 1 FROM {{schema}}.positions p WHERE p.instance_id = p_instance ORDER BY p.path FOR UPDATE;
    IF (SELECT count(*) FROM {{schema}}.positions p WHERE p.instance_id = p_instance)
           <> jsonb_array_length(p_positions)
       OR EXISTS (SELECT 1 FROM jsonb_array_elements(p_positions) e
                  LEFT JOIN {{schema}}.positions p ON p.instance_id = p_instance AND p.path = e->>'path'
                  WHERE p.path IS NULL OR p.step IS DISTINCT FROM e->>'step' OR p.visit <> (e->>'visit')::integer
                     OR p.status <> e->>'status') THEN
        RETURN QUERY SELECT 'changed', NULL::bigint;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM {{schema}}.positions p
               WHERE p.instance_id = p_instance AND p.lease_until IS NOT NULL AND p.lease_until > v_now)
       OR EXISTS (SELECT 1 FROM {{schema}}.commands c
                  WHERE c.instance_id = p_instance AND c.state = 'CLAIMED' AND c.available_at > v_now) THEN
        RETURN QUERY SELECT 'busy', NULL::bigint;
        RETURN;
    END IF;
    UPDATE {{schema}}.positions p SET
        step = e->>'to_step',
        wait = CASE WHEN e->'to_wait' = 'null'::jsonb THEN p.wait
                    -- a fork's: its own progress (a branch may have reported since the read), the new join
                    WHEN p.wait->>'kind' = 'join' AND e->'to_wait'->>'kind' = 'join'
                        THEN p.wait || jsonb_build_object('join', e->'to_wait'->'join')
                    ELSE e->'to_wait' END,
        updated_at = v_now
    FROM jsonb_array_elements(p_positions) e
    WHERE p.instance_id = p_instance AND p.path = e->>'path' AND e ? 'to_step';
    -- Its open commands take their mapped steps, and those a deferral routed to the old pin (version 76) go
    -- back to the definition's own key, where the workers of the new version walk them: dead letters too,
    -- which a retry of the instance queues again.
    UPDATE {{schema}}.commands c SET
        step = CASE WHEN c.state <> 'DEAD' AND c.step IS NOT NULL AND p_step_map ? c.step THEN p_step_map->>c.step
                    ELSE c.step END,
        definition = v_inst.definition_id, available_at = c.available_at  -- the wake-up names the definition
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                     AND ((x.state <> 'DEAD' AND x.step IS NOT NULL AND p_step_map ? x.step)
                          OR x.definition IS DISTINCT FROM v_inst.definition_id)
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET
        version = p_to_version, plan_hash = p_to_hash, state = p_state,
        state_version = i.state_version + 1,
        step = COALESCE((SELECT p.step FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
                        i.step),
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, payload, available_at, created_at,
                                     settled_at)
    VALUES (p_instance, '', nextval('{{schema}}.command_seq'), 'MIGRATION', 'COMPLETE',
            jsonb_build_object('from_version', p_from_version, 'to_version', p_to_version,
                               'to_plan_hash', p_to_hash, 'step_map', p_step_map),
            v_now, v_now, v_now)
    RETURNING id INTO v_id;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_MIGRATED',
            (SELECT p.step FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
            v_inst.visit, v_id, p_actor,
            jsonb_build_object('from_version', p_from_version, 'from_plan_hash', p_from_hash,
                               'to_version', p_to_version, 'to_plan_hash', p_to_hash,
                               'step_map', p_step_map, 'positions', p_positions, 'state', p_state));
    RETURN QUERY SELECT 'migrated', v_id;
END $$;

-- ==== version 9 (migration 0009_operations) ====
-- Operations: who asked for a command, redacted start baselines, queries, retention, replay.
--
-- Expand only. A command remembers who recorded it (`commands.actor`, filled from the
-- transaction-local setting `stepstone.actor` that the client's statements set, so no function that
-- inserts commands changes); an instance past its retention window is archived (`archived_at`, hidden
-- from lists by default) and later purged, in bounded batches that never wait for a lock.

-- Who recorded a command (the operator or service behind a start, a signal, a retry): the history
-- entries a worker writes for it name it as the one the worker acted on behalf of. A default, not a
-- trigger: evaluated per inserted row at no cost to the hot path, NULL where nothing set it.
ALTER TABLE {{schema}}.commands ADD COLUMN actor text DEFAULT NULLIF(current_setting('stepstone.actor', true), '');

-- Retention: archived instances are hidden from lists by default and purged after `purge_after`. An
-- archived instance that changed since (a retry, a replay) counts as not archived: it shows again,
-- is not purged, and is archived afresh once its new end is past its window.
ALTER TABLE {{schema}}.instances ADD COLUMN archived_at timestamptz;

-- Queries: the filters `stepstone instances find` offers, on columns an instance never changes after
-- its start (so commits stay HOT updates), newest first like the keyset pagination.
CREATE INDEX instances_definition_created ON {{schema}}.instances (definition_id, created_at, id);
-- (Newest first within a scope: instances_scope_created, from migration 0008, read backwards.)
-- Retention candidates: ended instances by age, archived ones by archive time.
CREATE INDEX instances_ended ON {{schema}}.instances (ended_at) WHERE ended_at IS NOT NULL AND archived_at IS NULL;
CREATE INDEX instances_archived ON {{schema}}.instances (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX outbox_published ON {{schema}}.outbox (published_at) WHERE published_at IS NOT NULL;
-- A purged instance's start key (dedup rows of kind START name their instance in `target`).
CREATE INDEX dedup_target ON {{schema}}.dedup (target) WHERE kind = 'START';

-- Retention windows as data, per workflow with a '*' default. A NULL window means "never on a timer"
-- (now() - NULL is NULL, so no comparison holds): waiting instances are kept until they end. An
-- instance past `retain_for` is archived; an archived one is purged `purge_after` later.
CREATE TABLE {{schema}}.retention_policies (
    workflow text NOT NULL,
    status_class text NOT NULL CHECK (status_class IN ('completed', 'failed', 'waiting', 'outbox_published')),
    retain_for interval,
    purge_after interval NOT NULL DEFAULT '1 day',
    PRIMARY KEY (workflow, status_class)
);
INSERT INTO {{schema}}.retention_policies (workflow, status_class, retain_for) VALUES
    ('*', 'completed', '30 days'),
    ('*', 'failed', '180 days'),
    ('*', 'waiting', NULL),
    ('*', 'outbox_published', '7 days');

-- The class of a status, as retention sees it. RUNNING and PENDING have none: never swept.
CREATE FUNCTION {{schema}}.retention_class(p_status text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN p_status IN ('COMPLETED', 'CANCELLED') THEN 'completed'
        WHEN p_status IN ('FAILED', 'TIMED_OUT', 'COMPENSATION_FAILED', 'COMPENSATED') THEN 'failed'
        WHEN p_status = 'WAITING' THEN 'waiting'
    END
$$;

-- The policy that applies: the workflow's own row, else the '*' default.
CREATE FUNCTION {{schema}}.retention_window(p_workflow text, p_class text)
RETURNS TABLE (retain_for interval, purge_after interval)
LANGUAGE sql STABLE AS $$
    SELECT r.retain_for, r.purge_after FROM {{schema}}.retention_policies r
    WHERE r.workflow IN (p_workflow, '*') AND r.status_class = p_class
    ORDER BY r.workflow = '*' LIMIT 1
$$;

-- retention_batch changes here; its one definition is in the version 22 section.

-- Published outbox rows past their window ('*', 'outbox_published'), oldest first, at most p_limit.
-- Rows a relay holds are skipped. Returns how many went (or would go, in a dry run).
CREATE FUNCTION {{schema}}.retention_outbox(p_limit integer, p_dry_run boolean)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_window interval := (SELECT w.retain_for FROM {{schema}}.retention_window('*', 'outbox_published') w);
    v_n integer;
BEGIN
    IF v_window IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM set_config('lock_timeout', '2s', true);
    IF p_dry_run THEN
        SELECT count(*) INTO v_n FROM (SELECT 1 FROM {{schema}}.outbox o
                                       WHERE o.published_at IS NOT NULL AND o.published_at < v_now - v_window
                                       LIMIT p_limit) x;
        RETURN v_n;
    END IF;
    DELETE FROM {{schema}}.outbox o WHERE o.id IN (
        SELECT x.id FROM {{schema}}.outbox x
        WHERE x.published_at IS NOT NULL AND x.published_at < v_now - v_window
        ORDER BY x.published_at LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $$;

-- A replay of a saga that had ended (COMPENSATED, TIMED_OUT, or CANCELLED after compensating) or
-- stopped (COMPENSATION_FAILED) runs the instance again. replay_instance answered "replayed" and wrote
-- INSTANCE_REPLAYED, but left the instance's `saga` set, and while it is set only the saga may change
-- the status: an ended saga stayed as it was and the step to run again was rejected (INSTANCE_ENDED);
-- a stopped one read COMPENSATION_FAILED while it ran. replay_instance now ends the saga first.
-- It locks the children before it writes, and a child under way that it awaits refuses it (version 83).
CREATE FUNCTION {{schema}}.replay_instance(p_instance uuid, p_step text, p_state jsonb, p_baseline jsonb,
                                           p_expected_seq integer, p_from_seq integer, p_actor text)
RETURNS TABLE (outcome text, status text, visit integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_visit integer;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text, NULL::integer;
        RETURN;
    END IF;
    IF v_inst.status IN ('PENDING', 'RUNNING', 'WAITING', 'COMPENSATING') THEN
        RETURN QUERY SELECT 'active', v_inst.status, NULL::integer;
        RETURN;
    END IF;
    IF v_inst.history_seq <> p_expected_seq THEN
        RETURN QUERY SELECT 'changed', v_inst.status, NULL::integer;
        RETURN;
    END IF;
    -- Positions (ascending path): branches closed, the root taken over with a fresh visit.
    PERFORM 1 FROM {{schema}}.positions p WHERE p.instance_id = p_instance ORDER BY p.path FOR UPDATE;
    -- Then the commands it supersedes (ascending id) and its children that have not ended for good (ascending
    -- id): the lock order, before anything is written. A retry of a FAILED child waits here and then finds
    -- its parent moved on (retry_instance); a child retried first is seen running. A child still under way
    -- (PENDING, RUNNING, WAITING) that a position of this instance awaits refuses the replay (outcome
    -- child_live; version 83): the replay would leave it running for a result nothing takes, beside the
    -- new child its step starts when it runs again.
    PERFORM 1 FROM {{schema}}.commands x
    WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'DEAD')
      AND NOT (x.kind = 'SIGNAL' AND x.state <> 'CLAIMED')
    ORDER BY x.id FOR UPDATE;
    PERFORM 1 FROM {{schema}}.instances x
    WHERE x.parent_id = p_instance AND NOT {{schema}}.is_terminal(x.status) ORDER BY x.id FOR UPDATE;
    IF EXISTS (SELECT 1 FROM {{schema}}.instances x
               WHERE x.parent_id = p_instance AND x.status IN ('PENDING', 'RUNNING', 'WAITING')
                 AND {{schema}}.child_standing(x) = 'awaited') THEN
        RETURN QUERY SELECT 'child_live', v_inst.status, NULL::integer;
        RETURN;
    END IF;
    SELECT COALESCE(max(h.visit), 0) + 1 INTO v_visit FROM {{schema}}.history h
    WHERE h.instance_id = p_instance AND COALESCE(h.position, '') = '';
    v_visit := GREATEST(v_visit, (SELECT p.visit + 1 FROM {{schema}}.positions p
                                  WHERE p.instance_id = p_instance AND p.path = ''));
    UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = v_now
    WHERE p.instance_id = p_instance AND p.path <> '' AND p.status NOT IN ('COMPLETED', 'CANCELLED');
    UPDATE {{schema}}.positions p SET status = 'RUNNING', step = p_step, visit = v_visit, wait = NULL,
        error = NULL, lease_token = NULL, lease_until = NULL, lease_owner = NULL, updated_at = v_now
    WHERE p.instance_id = p_instance AND p.path = '';
    -- Commands (ascending id): what the old path still had open is superseded.
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'REPLAYED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'DEAD')
                     AND NOT (x.kind = 'SIGNAL' AND x.state <> 'CLAIMED')
                   ORDER BY x.id FOR UPDATE);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at, created_at,
                                     actor)
    VALUES (p_instance, '', nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', p_step, v_visit, v_now, v_now,
            p_actor);
    -- A child its saga asked to compensate that has not ended (it stopped at COMPENSATION_FAILED) answers
    -- that saga no more: its link (`saga.record`) is settled, and marked, so that a retry of the child,
    -- which would undo it under a parent that goes on, is refused (retry_saga). A later round of this
    -- saga that reaches the child asks it again (compensate_child). Child rows after the parent's
    -- positions and commands, in ascending id order: the lock order.
    UPDATE {{schema}}.instances c SET saga = (c.saga - 'record') || jsonb_build_object('parent_replayed', v_now),
        updated_at = v_now
    WHERE c.id IN (SELECT x.id FROM {{schema}}.instances x
                   WHERE x.parent_id = p_instance AND x.ended_at IS NULL AND x.saga ? 'record'
                   ORDER BY x.id FOR UPDATE);
    -- The instance goes forward again: a saga it ran is over (its compensations stay recorded, and one
    -- given up is owed by the next round, saga_owe_given_up). Cleared on its own first, since while
    -- `saga` is set only the saga may change the status (instance_status_changed).
    UPDATE {{schema}}.instances i SET saga = NULL WHERE i.id = p_instance AND i.saga IS NOT NULL;
    UPDATE {{schema}}.instances i SET status = 'RUNNING', state = p_state, state_version = i.state_version + 1,
        step = p_step, visit = v_visit, wait = NULL, error = NULL, branches = 0, ended_at = NULL,
        archived_at = NULL, history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data, position)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_REPLAYED', p_step, v_visit, p_actor,
            jsonb_build_object('from_step', p_step, 'from_seq', p_from_seq, 'previous_status', v_inst.status,
                               'state', p_baseline), '');
    RETURN QUERY SELECT 'replayed', 'RUNNING'::text, v_visit;
END $$;

-- Redaction of start baselines: every path the definition marks sensitive (definitions.plan ->
-- 'sensitive', a list of key paths where '*' is any list item) is replaced by "[redacted]" in the
-- state an INSTANCE_STARTED entry copies. The live state the handlers need keeps the value.
CREATE FUNCTION {{schema}}.redact_path(p_doc jsonb, p_path text[]) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_head text := p_path[1];
    v_rest text[] := p_path[2:];
    v_out jsonb;
BEGIN
    IF p_doc IS NULL OR cardinality(p_path) = 0 OR jsonb_typeof(p_doc) = 'null' THEN
        RETURN p_doc;
    END IF;
    IF v_head = '*' THEN
        IF jsonb_typeof(p_doc) <> 'array' THEN
            RETURN p_doc;
        END IF;
        SELECT COALESCE(jsonb_agg(CASE WHEN cardinality(v_rest) = 0 THEN '"[redacted]"'::jsonb
                                       ELSE {{schema}}.redact_path(e, v_rest) END ORDER BY o), '[]'::jsonb)
        INTO v_out FROM jsonb_array_elements(p_doc) WITH ORDINALITY AS t(e, o);
        RETURN v_out;
    END IF;
    IF jsonb_typeof(p_doc) <> 'object' OR NOT p_doc ? v_head OR jsonb_typeof(p_doc -> v_head) = 'null' THEN
        RETURN p_doc;
    END IF;
    IF cardinality(v_rest) = 0 THEN
        RETURN jsonb_set(p_doc, ARRAY[v_head], '"[redacted]"'::jsonb);
    END IF;
    RETURN jsonb_set(p_doc, ARRAY[v_head], {{schema}}.redact_path(p_doc -> v_head, v_rest));
END $$;

-- The baseline's redaction read the sensitive paths of the registration in the instance's own scope,
-- but an instance in a scope with no registration of its own runs the default scope's
-- (definition_scope, set by the pin admission): it found no paths, and a sensitive input value was
-- kept in the INSTANCE_STARTED entry. It now reads the registration the pin was admitted against.
CREATE FUNCTION {{schema}}.redact_baseline() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_paths jsonb;
    v_path jsonb;
    v_state jsonb;
BEGIN
    SELECT d.plan -> 'sensitive' INTO v_paths
    FROM {{schema}}.instances i
    JOIN {{schema}}.definitions d ON d.scope = COALESCE(i.definition_scope, i.scope)
                                  AND d.definition_id = i.definition_id AND d.version = i.version
    WHERE i.id = NEW.instance_id;
    IF v_paths IS NULL OR jsonb_typeof(v_paths) <> 'array' OR NEW.data IS NULL OR NOT NEW.data ? 'state' THEN
        RETURN NEW;
    END IF;
    v_state := NEW.data -> 'state';
    FOR v_path IN SELECT jsonb_array_elements(v_paths) LOOP
        v_state := {{schema}}.redact_path(v_state, ARRAY(SELECT jsonb_array_elements_text(v_path)));
    END LOOP;
    NEW.data := jsonb_set(NEW.data, '{state}', v_state);
    RETURN NEW;
END $$;

-- Only start entries: the WHEN clause is checked without calling the function, so the history rows a
-- commit writes pay nothing for it (the worker redacts those before they leave it).
CREATE TRIGGER history_redact_baseline BEFORE INSERT ON {{schema}}.history
    FOR EACH ROW WHEN (NEW.kind = 'INSTANCE_STARTED') EXECUTE FUNCTION {{schema}}.redact_baseline();

-- ==== version 10 (migration 0010_external_tasks) ====
-- External tasks: work an external step hands to outside workers, in any language.
--
-- A task row is written by the commit that enters the step (the 'external_tasks' feature section),
-- at the position's step visit; its id is derived from them, so an operator's retry of the failed
-- position re-opens the same row with fresh retries. Workers fetch and lock tasks by topic with
-- SKIP LOCKED; each lock has its own token and an expiry on the db clock, and every answer (extend,
-- complete, business error, failure) is fenced on that token and refused once the lock expired.
-- An answer that ends the task becomes an EXTERNAL_COMPLETION command on the position, in the same
-- transaction: a task is answered once.
--
-- status: OPEN (fetchable when available_at <= db_now(); while locked, available_at is the lock's
-- expiry, so an expired lock makes it fetchable again), COMPLETED, ERROR (a business error),
-- FAILED (no retries left: an incident on the instance) or CANCELLED (its position no longer waits
-- for it: closed when a fetch or an answer finds so). Lock order: instance row -> its task rows.
CREATE TABLE {{schema}}.external_tasks (
    id uuid PRIMARY KEY,
    instance_id uuid NOT NULL,
    position text NOT NULL,
    step text NOT NULL,
    visit integer NOT NULL,
    topic text NOT NULL,
    payload jsonb,
    status text NOT NULL,
    retries integer NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    backoff jsonb NOT NULL,
    available_at timestamptz NOT NULL,
    lock_token uuid,
    lock_owner text,
    lock_until timestamptz,
    locks integer NOT NULL DEFAULT 0,
    last_error text,
    error_details jsonb,
    command_id bigint,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    ended_at timestamptz
) WITH (fillfactor = 70);

CREATE INDEX external_tasks_open ON {{schema}}.external_tasks (topic, available_at, id) WHERE status = 'OPEN';
CREATE INDEX external_tasks_instance ON {{schema}}.external_tasks (instance_id);

-- Long polling: a task that becomes fetchable now notifies one channel per schema (payload: its topic).
CREATE FUNCTION {{schema}}.notify_external_task() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'OPEN' AND NEW.lock_token IS NULL AND NEW.available_at <= {{schema}}.db_now() THEN
        PERFORM pg_notify(left('stepstone_external_' || TG_TABLE_SCHEMA, 63), NEW.topic);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER external_tasks_notify
    AFTER INSERT OR UPDATE OF status, available_at, lock_token ON {{schema}}.external_tasks
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.notify_external_task();

-- The feature section: the tasks a commit opens (effect OpenExternalTask), at the committing position.
CREATE FUNCTION {{schema}}.open_external_tasks(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.external_tasks AS t
        (id, instance_id, position, step, visit, topic, payload, status, retries, attempts, backoff,
         available_at, created_at, updated_at)
    SELECT (x->>'task_id')::uuid, (p_commit->>'instance')::uuid, p_commit->>'position', x->>'step',
           (x->>'visit')::integer, x->>'topic', x->'payload', 'OPEN', (x->>'retries')::integer, 0, x->'backoff',
           p_now, p_now, p_now
    FROM jsonb_array_elements(p_items) AS x
    ORDER BY (x->>'task_id')::uuid
    ON CONFLICT (id) DO UPDATE SET
        topic = EXCLUDED.topic, payload = EXCLUDED.payload, status = 'OPEN', retries = EXCLUDED.retries,
        attempts = 0, backoff = EXCLUDED.backoff, available_at = p_now, lock_token = NULL, lock_owner = NULL,
        lock_until = NULL, last_error = NULL, error_details = NULL, command_id = NULL, updated_at = p_now,
        ended_at = NULL;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('external_tasks', 50, 'open_external_tasks');

-- An answer that ends task p_task, fenced on p_token: p_outcome 'completed' (with p_variables),
-- 'error' (p_error: code, message, details) or 'failed' (p_error: message, details; p_retries and
-- p_retry_delay may override the task's own retry metadata: retried while retries remain).
-- outcome: 'recorded' (command_id: the EXTERNAL_COMPLETION on the position), 'retrying'
-- (available_at: when it is offered again; the attempt is in the history, migration 0049), 'duplicate' (this lock already answered so: the same
-- command), 'not_found', 'lock_lost' (the token does not hold the task: never locked by it, or the
-- lock moved to another worker), 'lock_expired', 'not_open' (the task already ended; status says
-- how) or 'not_awaited' (its position no longer waits for it; the task is cancelled).
CREATE FUNCTION {{schema}}.answer_external_task(
    p_task uuid, p_token uuid, p_outcome text, p_variables jsonb, p_error jsonb, p_retries integer,
    p_retry_delay float8, p_worker text)
RETURNS TABLE (outcome text, command_id bigint, status text, available_at timestamptz, retries integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst uuid;
    t {{schema}}.external_tasks%ROWTYPE;
    v_left integer;
    v_delay float8;
    v_end text;
    v_id bigint;
BEGIN
    SELECT x.instance_id INTO v_inst FROM {{schema}}.external_tasks x WHERE x.id = p_task;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint, NULL::text, NULL::timestamptz, NULL::integer;
        RETURN;
    END IF;
    PERFORM 1 FROM {{schema}}.instances i WHERE i.id = v_inst FOR UPDATE;
    SELECT * INTO t FROM {{schema}}.external_tasks x WHERE x.id = p_task FOR UPDATE;
    -- A failure sent again with the token its retry released (a worker that lost the reply): that answer.
    IF p_outcome = 'failed' AND t.released_token = p_token THEN
        RETURN QUERY SELECT 'duplicate', NULL::bigint, t.status, NULL::timestamptz, NULL::integer;
        RETURN;
    END IF;
    IF t.lock_token IS DISTINCT FROM p_token THEN
        RETURN QUERY SELECT 'lock_lost', NULL::bigint, t.status, t.available_at, t.retries;
        RETURN;
    END IF;
    IF t.status <> 'OPEN' THEN
        RETURN QUERY SELECT CASE WHEN t.command_id IS NOT NULL
                                  AND t.status = CASE p_outcome WHEN 'completed' THEN 'COMPLETED'
                                                                WHEN 'error' THEN 'ERROR' ELSE 'FAILED' END
                                 THEN 'duplicate' ELSE 'not_open' END,
                            t.command_id, t.status, t.available_at, t.retries;
        RETURN;
    END IF;
    IF t.lock_until <= v_now THEN
        RETURN QUERY SELECT 'lock_expired', NULL::bigint, t.status, t.available_at, t.retries;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                   WHERE p.instance_id = t.instance_id AND p.path = t.position AND p.status = 'WAITING'
                     AND p.step = t.step AND p.visit = t.visit) THEN
        UPDATE {{schema}}.external_tasks x SET status = 'CANCELLED', last_error = 'NOT_AWAITED', updated_at = v_now,
            ended_at = v_now
        WHERE x.id = p_task;
        RETURN QUERY SELECT 'not_awaited', NULL::bigint, 'CANCELLED'::text, t.available_at, t.retries;
        RETURN;
    END IF;
    IF p_outcome = 'failed' THEN
        v_left := COALESCE(p_retries, t.retries - 1);
        IF v_left > 0 THEN
            v_delay := COALESCE(p_retry_delay, LEAST((t.backoff->>'max')::float8,
                (t.backoff->>'initial')::float8 * power((t.backoff->>'multiplier')::float8, t.attempts)));
            UPDATE {{schema}}.external_tasks x SET retries = v_left, attempts = x.attempts + 1,
                last_error = p_error->>'message', error_details = p_error->'details',
                available_at = v_now + make_interval(secs => GREATEST(v_delay, 0)),
                lock_token = NULL, released_token = p_token, lock_owner = NULL, lock_until = NULL,
                updated_at = v_now
            WHERE x.id = p_task
            RETURNING x.available_at INTO t.available_at;
            -- The attempt, in the instance's history (a failure without retries left is recorded by the
            -- worker that applies its EXTERNAL_COMPLETION: EXTERNAL_TASK_FAILED).
            PERFORM {{schema}}.append_history(
                t.instance_id, t.position, 'EXTERNAL_TASK_ATTEMPT_FAILED', t.step, t.visit,
                jsonb_build_object('kind', 'service', 'id', COALESCE(p_worker, t.lock_owner))::text,
                jsonb_build_object('task_id', t.id, 'worker', COALESCE(p_worker, t.lock_owner),
                                   'message', p_error->>'message', 'details', p_error->'details',
                                   'attempt', t.attempts + 1, 'retries', v_left, 'available_at', t.available_at),
                v_now);
            RETURN QUERY SELECT 'retrying', NULL::bigint, 'OPEN'::text, t.available_at, v_left;
            RETURN;
        END IF;
    END IF;
    v_end := CASE p_outcome WHEN 'completed' THEN 'COMPLETED' WHEN 'error' THEN 'ERROR' ELSE 'FAILED' END;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, payload, available_at,
                                     created_at)
    VALUES (t.instance_id, t.position, nextval('{{schema}}.command_seq'), 'EXTERNAL_COMPLETION', 'PENDING', t.step,
            t.visit, jsonb_build_object('task_id', t.id, 'outcome', p_outcome, 'variables', p_variables,
                                        'error', p_error, 'worker', COALESCE(p_worker, t.lock_owner),
                                        'attempts', t.attempts + 1),
            v_now, v_now)
    RETURNING id INTO v_id;
    UPDATE {{schema}}.external_tasks x SET status = v_end, command_id = v_id, updated_at = v_now, ended_at = v_now,
        retries = CASE WHEN p_outcome = 'failed' THEN 0 ELSE x.retries END,
        attempts = x.attempts + CASE WHEN p_outcome = 'failed' THEN 1 ELSE 0 END,
        last_error = CASE WHEN p_outcome = 'completed' THEN x.last_error ELSE p_error->>'message' END,
        error_details = CASE WHEN p_outcome = 'completed' THEN x.error_details ELSE p_error->'details' END
    WHERE x.id = p_task;
    RETURN QUERY SELECT 'recorded', v_id, v_end, t.available_at, t.retries;
END $$;

-- Outbox: an operator may discard a dead-lettered event (`stepstone outbox discard`) instead of
-- requeueing it. It leaves the unpublished set (published_at is set, so its key resumes and the
-- retention guard no longer holds its instance) and stays visible as discarded, never as published.
ALTER TABLE {{schema}}.outbox ADD COLUMN discarded_at timestamptz;

-- ==== version 11 (migration 0011_schedules_flow) ====
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

-- fire_schedule changes here; its one definition is in the version 50 section.

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

-- flow_on_start read the clock before it knew there was a limit: now only when there is one (a start of a
-- workflow without a flow limit, the common case, runs two index lookups and returns).
CREATE FUNCTION {{schema}}.flow_on_start() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_inst record;
    v_lim {{schema}}.flow_limits%ROWTYPE;
    v_key text;
    v_now timestamptz;
BEGIN
    SELECT i.scope, i.definition_id, i.business_key, i.state INTO v_inst
    FROM {{schema}}.instances i WHERE i.id = NEW.instance_id;
    SELECT * INTO v_lim FROM {{schema}}.flow_limits l
    WHERE l.scope = v_inst.scope AND l.definition_id = v_inst.definition_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_now := {{schema}}.db_now();
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

-- ==== version 12 (migration 0012_commit_path) ====
-- Commit path, round 2 (performance): the same writes with fewer statements per start and fewer clock
-- reads per claim.
--
-- start_instance: the dedup row, instance, root position, START command and history row in one
-- statement instead of five. db_now: plpgsql, so its plan is kept for the session (the claim reads it
-- once per statement now, see queries.sql). docs/performance-history.md ("Commit path, round 2") has the
-- measurements that chose these shapes.

-- start_instance changes here; its one definition is in the version 1 section.

-- db_now changes here; its one definition is in the version 1 section.

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
-- (Newest first within a scope: instances_scope_created (migration 0027), read backwards.)

-- One instance's events, published or not (the instance page; outbox_unsent_instance covers only
-- the unpublished ones).
CREATE INDEX outbox_instance ON {{schema}}.outbox (instance_id, id);

-- ==== version 14 (migration 0014_task_filters) ====
-- Saved inbox filters (issue 11): a user names a filter of the task inbox (its mode and its
-- narrowing, as the client's TaskFilter spells it) and lists, uses and deletes it later. One row per
-- (scope, owner, name); saving a name again replaces its filter. Nothing else reads or locks this
-- table, so it takes no place in the lock order.
CREATE TABLE {{schema}}.task_filters (
    scope text NOT NULL,
    owner text NOT NULL,
    name text NOT NULL,
    mode text NOT NULL,
    filter jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (scope, owner, name)
);

-- ==== version 15 (migration 0015_redacted_payloads) ====
-- Redaction of command payloads: a signal's, message's or task decision's payload may hold values its
-- workflow marks sensitive (`wait(..., payloads=...)`, `task(..., payloads=...)`). The handler needs
-- them, so they stay whole while the command is open; the commit that settles the command for good
-- stores its payload with those values replaced (core/redaction.py computes it), and for a task
-- completion the copy the task row keeps. Rows it changes: the claimed command, which this commit
-- holds already, then the task (a feature row, after the commands in the lock order, which the
-- commit's task section has locked already).
CREATE FUNCTION {{schema}}.redact_claimed_payload(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_item jsonb := p_items -> -1;
BEGIN
    UPDATE {{schema}}.commands c SET payload = NULLIF(v_item -> 'payload', 'null'::jsonb)
    WHERE c.id = (p_commit->>'command')::bigint AND c.instance_id = (p_commit->>'instance')::uuid;
    IF v_item ->> 'task_id' IS NOT NULL THEN
        UPDATE {{schema}}.tasks k SET completion = jsonb_set(k.completion, '{payload}', v_item -> 'task_payload')
        WHERE k.id = (v_item ->> 'task_id')::uuid AND k.instance_id = (p_commit->>'instance')::uuid
          AND k.completion ? 'payload';
    END IF;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('redacted_payloads', 60, 'redact_claimed_payload');

-- ==== version 16 (migration 0016_saga_children_deadlines) ====
-- Sagas, second part (core/saga.py): a child its parent's saga finds still running is compensated,
-- not cancelled, and a step deadline on any kind of step (a wait, a task, a child; the start step).
--
-- A running child: when the parent's saga begins, every child still open that goes with its parent
-- (cancel_with_parent) becomes a compensation of the parent, the newest (it is what the parent was
-- doing last), so it is undone first: its COMPENSATE asks the child to cancel with compensation (its
-- positions close and lose their leases, its completed steps are compensated in its own reverse
-- order) and the parent's saga waits on '$saga' until the child reports how that ended. A child
-- already compensating on its own is asked only to report. Who reports to a parent's saga is now
-- marked by `saga.record` (the parent's compensation the child answers), not by the cause 'parent'.
--
-- Lock order as in 0006: the parent's instance row (taken by its commit) -> its positions -> its
-- commands -> the child's instance row -> the child's positions and commands -> compensations ->
-- history. A child never waits on its parent's rows: it reports by inserting a command.

-- tell_parent changes here; its one definition is in the version 6 section.

-- The children a saga takes over when it begins, recorded as the parent's newest compensations: a child that
-- completed while the parent's position waited for it, whose COMPLETED report (CHILD_COMPLETION) the parent has
-- not applied (queued, or claimed by a worker applying it), recorded as that report would have recorded it
-- (core/saga.py, on_child_completed: in a plan that declares a compensation, a child that goes with its parent;
-- version 90), then the children still open that go with their parent, each set in ascending child id order
-- (the highest id is undone first).
-- One statement, one snapshot: a child whose last commit lands meanwhile is seen either open or COMPLETED with
-- its report queued (one commit wrote both), never neither. saga_begin calls it first, while the positions
-- still wait, before they close and the report is settled unapplied. Child rows are read, not locked:
-- compensate_child locks each when the saga reaches it.
CREATE FUNCTION {{schema}}.record_open_children(p_instance uuid, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT p_instance, t.path, t.step, t.visit, t.recorded, p_now
    FROM (
        SELECT 1 AS part, r.child_id AS id, r.path, r.step, r.visit,
               jsonb_build_object('kind', 'child', 'child_id', r.child_id) AS recorded
        FROM {{schema}}.reported_children(p_instance, '', NULL) r
        UNION ALL
        SELECT 2, c.id, coalesce(c.parent_position, ''),
               coalesce((SELECT p.step FROM {{schema}}.positions p
                         WHERE p.instance_id = p_instance AND p.path = coalesce(c.parent_position, '')
                           AND p.visit = c.parent_visit), c.definition_id),
               coalesce(c.parent_visit, 0), jsonb_build_object('kind', 'child', 'child_id', c.id, 'open', true)
        FROM {{schema}}.instances c
        WHERE c.parent_id = p_instance AND c.cancel_with_parent AND c.ended_at IS NULL
    ) AS t
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.compensations k
                      WHERE k.instance_id = p_instance AND k.recorded->>'kind' = 'child'
                        AND k.recorded->>'child_id' = t.id::text)
    ORDER BY t.part, t.id;
END $$;

-- saga_begin changes here; its one definition is in the version 6 section.

-- compensate_child changes here; its one definition is in the version 6 section.

-- saga_next changes here; its one definition is in the version 6 section.

-- advance_saga changes here; its one definition is in the version 6 section.

-- interrupt_steps changes here; its one definition is in the version 6 section.

-- The start's timers, in the start's own statement: the instance deadline (schedule_deadline) and the
-- start step's deadline (`p_step` entered at visit 1 on the root position; its TIMER queues on '$saga'
-- like every step deadline). A repeated start (p_instance NULL) schedules nothing.
CREATE FUNCTION {{schema}}.schedule_start_deadlines(p_instance uuid, p_at timestamptz, p_seconds float8,
                                                    p_step text, p_step_seconds float8)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    PERFORM {{schema}}.schedule_deadline(p_instance, p_at, p_seconds);
    IF p_instance IS NULL OR p_step_seconds IS NULL THEN
        RETURN p_instance;
    END IF;
    PERFORM {{schema}}.open_saga_position(p_instance, v_now);
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     available_at, created_at)
    VALUES (p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', p_step, 1, 'step_deadline',
            jsonb_build_object('position', '', 'step', p_step, 'visit', 1),
            v_now + make_interval(secs => p_step_seconds), v_now);
    RETURN p_instance;
END $$;

-- An instance that completed or was cancelled keeps that status. A late command on one of its
-- positions (a detached child reporting to a cancelled parent, say) commits a status derived from
-- its live positions, and with none live that derivation reads WAITING. What reopens an ended
-- instance on purpose clears its ended_at in the same update: a replay (replay_instance) or a saga
-- (a completed child its parent compensates, which also marks the row `saga` first, so the saga's
-- own trigger decides from then on). A commit never clears ended_at.
CREATE TRIGGER instances_keep_ended_status
    BEFORE UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (OLD.saga IS NULL AND OLD.status IN ('COMPLETED', 'CANCELLED')
                       AND OLD.status IS DISTINCT FROM NEW.status
                       AND NEW.ended_at IS NOT DISTINCT FROM OLD.ended_at)
    EXECUTE FUNCTION {{schema}}.keep_saga_status();

-- ==== version 17 (migration 0017_migration_order) ====
-- In-flight migration in the instance's command order, and deferrals an operator can see.
--
-- Expand only: two new functions; migrate_instance (0008) stays for callers of the previous release.
--
-- migrate_in_order(p_order_seq, ...) is migrate_instance with the migration's place in the order:
-- the caller reserves a command seq when it first plans the migration, and the migration applies
-- only once every command queued before that seq which can run now has run ('queued' until then),
-- so a signal sent before the migration is applied on the version it was sent to, and the MIGRATION
-- command is recorded at the reserved seq. A command that cannot run does not hold the migration
-- back, since the migration is how such an instance moves: one deferred because the workers that
-- claimed it lack the plan (NOT_RUNNABLE), and any command of an instance whose pinned plan no worker
-- served within the last p_served_within seconds (worker_plans, the stranded report's rule).
CREATE FUNCTION {{schema}}.migrate_in_order(
    p_order_seq bigint, p_instance uuid, p_from_version integer, p_from_hash text, p_state_version bigint,
    p_to_version integer, p_to_hash text, p_step_map jsonb, p_positions jsonb, p_state jsonb, p_actor text,
    p_served_within double precision)
RETURNS TABLE (outcome text, command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_inst {{schema}}.instances%ROWTYPE;
    v_outcome text;
    v_id bigint;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;  -- first in the lock order
    IF EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
               WHERE w.definition_id = v_inst.definition_id AND w.version = v_inst.version
                 AND w.plan_hash = v_inst.plan_hash
                 AND w.seen_at > {{schema}}.db_now() - make_interval(secs => p_served_within))
       AND EXISTS (SELECT 1 FROM {{schema}}.commands c
               WHERE c.instance_id = p_instance AND c.seq < p_order_seq
                 AND c.state IN ('PENDING', 'DEFERRED') AND c.available_at <= {{schema}}.db_now()
                 AND NOT (c.state = 'DEFERRED' AND c.last_error LIKE 'NOT\_RUNNABLE%')) THEN
        RETURN QUERY SELECT 'queued', NULL::bigint;
        RETURN;
    END IF;
    SELECT m.outcome, m.command_id INTO v_outcome, v_id
    FROM {{schema}}.migrate_instance(p_instance, p_from_version, p_from_hash, p_state_version, p_to_version,
                                     p_to_hash, p_step_map, p_positions, p_state, p_actor) m;
    IF v_id IS NOT NULL THEN
        UPDATE {{schema}}.commands c SET seq = p_order_seq WHERE c.id = v_id;
    END IF;
    RETURN QUERY SELECT v_outcome, v_id;
END $$;

-- A worker that lacks the pinned plan hands the command back (the claim it spent restored) and says so
-- in the instance's history: COMMAND_DEFERRED names the command, the pin no live worker served, the
-- backoff and when it is tried again, so an operator can see why the instance does not move. Locks:
-- instance row -> position -> commands of that position -> history.
-- Since version 76 the command, and the open commands queued behind it on its position, move to the route
-- of the instance's pin (command_route), which only the workers that have the plan walk: claimable at once,
-- no backoff. One deferred again on its route (by a claim given no served list, which walks every key)
-- backs off as version 70 had it: min(0.25 s * 2^deferrals, 1 s) while a worker that has the pin
-- heartbeats, else min(5 s * 2^deferrals, 5 min). Why: the migration's header.
CREATE FUNCTION {{schema}}.defer_command(p_instance uuid, p_path text, p_token uuid, p_reason text)
RETURNS TABLE (command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_cmd {{schema}}.commands%ROWTYPE;
    v_route text;
    v_backoff double precision := 0;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
    WHERE p.instance_id = p_instance AND p.path = p_path AND p.lease_token = p_token;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO v_cmd FROM {{schema}}.commands c
    WHERE c.instance_id = p_instance AND c.position = p_path AND c.token = p_token AND c.state = 'CLAIMED'
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_route := {{schema}}.command_route(v_inst.definition_id, v_inst.version, v_inst.plan_hash);
    IF v_cmd.definition = v_route THEN  -- already routed: taken by a claim that walks every key
        IF EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
                   WHERE w.definition_id = v_inst.definition_id AND w.version = v_inst.version
                     AND w.plan_hash = v_inst.plan_hash AND w.seen_at > v_now - interval '30 seconds') THEN
            v_backoff := LEAST(1, 0.25 * power(2, v_cmd.deferrals));  -- a worker that has it is up
        ELSE
            v_backoff := LEAST(300, 5 * power(2, v_cmd.deferrals));
        END IF;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'DEFERRED', token = NULL, claims = GREATEST(c.claims - 1, 0),
        deferrals = c.deferrals + 1, last_error = p_reason, available_at = v_now + make_interval(secs => v_backoff),
        definition = v_route
    WHERE c.id = v_cmd.id;
    -- The open commands queued behind it on its position follow it (a claim takes none of them without this
    -- position's row, which this transaction holds); available_at is set so that their wake-up names the route.
    UPDATE {{schema}}.commands c SET definition = v_route, available_at = c.available_at
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.position = p_path
                     AND x.state IN ('PENDING', 'DEFERRED', 'PARKED') AND x.definition IS DISTINCT FROM v_route
                   ORDER BY x.id FOR UPDATE);
    PERFORM {{schema}}.append_history(
        p_instance, p_path, 'COMMAND_DEFERRED', v_cmd.step, v_cmd.visit, NULL,
        jsonb_build_object('command', v_cmd.id, 'kind', v_cmd.kind, 'reason', p_reason,
                           'deferrals', v_cmd.deferrals + 1, 'backoff_seconds', v_backoff,
                           'retry_at', v_now + make_interval(secs => v_backoff),
                           'pin', jsonb_build_object('scope', v_inst.definition_scope,
                                                     'definition_id', v_inst.definition_id,
                                                     'version', v_inst.version, 'plan_hash', v_inst.plan_hash)),
        v_now);
    RETURN QUERY SELECT v_cmd.id;
END $$;

-- ==== version 18 (migration 0018_caller_transaction_publish) ====
-- Publishing a message inside the caller's own transaction (Client.publish_message(connection=...)).
--
-- publish_message takes each matching instance's row with NOWAIT, so a publish never waits behind a
-- worker's commit while it holds the correlation lock; on a pool connection the client tries again.
-- On the caller's connection an error would abort the caller's whole transaction, business write
-- included, so this function tries again itself: each attempt runs in a subtransaction (the
-- EXCEPTION block), so a refused attempt leaves nothing behind, its locks included. The instance cap
-- (SQLSTATE SC429) and a matching instance that stays busy come back as outcomes ('limit', 'busy'),
-- not errors: the caller's transaction stays usable, as after a refused start.
CREATE FUNCTION {{schema}}.publish_in_caller_transaction(p_name text, p_key text, p_payload jsonb,
                                                         p_message_id text, p_ttl float8, p_all boolean,
                                                         p_fingerprint text)
RETURNS TABLE (outcome text, deliveries jsonb, expires_at timestamptz, status text, detail text,
               cap integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_delay float8 := 0.002;
    v_detail text;
    v_cap text;
BEGIN
    -- About five seconds in all, as the client's own retries (postgres_tasks._BUSY_ATTEMPTS).
    FOR attempt IN 1..200 LOOP
        BEGIN
            RETURN QUERY SELECT m.outcome, m.deliveries, m.expires_at, m.status, NULL::text,
                                NULL::integer
                         FROM {{schema}}.publish_message(p_name, p_key, p_payload, p_message_id, p_ttl, p_all,
                                                         p_fingerprint) AS m;
            RETURN;
        EXCEPTION
            WHEN lock_not_available THEN
                PERFORM pg_sleep(v_delay);
                v_delay := least(v_delay * 2, 0.05);
            WHEN SQLSTATE 'SC429' THEN
                GET STACKED DIAGNOSTICS v_detail = MESSAGE_TEXT, v_cap = PG_EXCEPTION_DETAIL;
                RETURN QUERY SELECT 'limit'::text, '[]'::jsonb, NULL::timestamptz, 'LIMIT'::text, v_detail,
                                    v_cap::integer;
                RETURN;
            WHEN SQLSTATE 'SSM01' THEN  -- a ttl under a microsecond (migration 0078)
                GET STACKED DIAGNOSTICS v_detail = MESSAGE_TEXT;
                RETURN QUERY SELECT 'invalid'::text, '[]'::jsonb, NULL::timestamptz, 'INVALID'::text, v_detail,
                                    NULL::integer;
                RETURN;
        END;
    END LOOP;
    RETURN QUERY SELECT 'busy'::text, '[]'::jsonb, NULL::timestamptz, 'BUSY'::text, NULL::text, NULL::integer;
END $$;

-- ==== version 19 (migration 0019_token_groups) ====
-- The groups an API token's user belongs to: the task inbox offers that user the tasks whose
-- candidate groups include one of them (`stepstone tokens create --group finance`). Empty for the
-- tokens made before, which keep working as they did (tasks assigned to them or offered to their name).
ALTER TABLE {{schema}}.api_tokens ADD COLUMN groups text[] NOT NULL DEFAULT '{}';

-- ==== version 20 (migration 0020_message_payloads) ====
-- A published message's row keeps its payload only while it is buffered (it is delivered from there).
-- Delivered, its payload lives in the MESSAGE command of each instance it reached, which the commit
-- settling it stores redacted by that workflow's payload model (migration 0015); dropped, nothing
-- needs it; expired (the retention sweep marks a buffered message past its TTL EXPIRED), neither.
-- A trigger, so every path that writes the row (publish_message, a buffered message taken by a new
-- subscription, the sweep) obeys it without repeating it.
CREATE FUNCTION {{schema}}.message_payload_while_buffered() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> 'BUFFERED' THEN
        NEW.payload := NULL;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER messages_payload_while_buffered BEFORE INSERT OR UPDATE OF status, payload ON {{schema}}.messages
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.message_payload_while_buffered();

UPDATE {{schema}}.messages SET payload = NULL WHERE status <> 'BUFFERED' AND payload IS NOT NULL;

-- ==== version 21 (migration 0021_start_or_signal_deadlines) ====
-- Signal-with-start starts an instance as a start does: with the caller's durable context, the
-- instance deadline (an instant or seconds from now; the workflow's default when the caller gives
-- none) and the start step's deadline. start_or_signal (migration 0007) scheduled neither deadline,
-- so an instance started by a signal could never time out. It now calls this one.
CREATE FUNCTION {{schema}}.start_or_signal_with(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text, p_state jsonb,
    p_step text, p_business_key text, p_start_fingerprint text, p_actor text, p_signal text, p_payload jsonb,
    p_dedup_key text, p_signal_fingerprint text, p_context jsonb, p_deadline_at timestamptz,
    p_deadline_seconds float8, p_start_deadline_seconds float8)
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
            PERFORM {{schema}}.schedule_start_deadlines(
                {{schema}}.start_with_context(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state, p_step,
                                              p_business_key, NULL, p_start_fingerprint, p_actor, p_context),
                p_deadline_at, p_deadline_seconds, p_step, p_start_deadline_seconds);
            v_target := p_id;
            v_started := true;
        EXCEPTION WHEN unique_violation THEN
            SELECT i.id INTO v_target FROM {{schema}}.instances i
            WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
        END;
    END IF;
    SELECT * INTO r FROM {{schema}}.signal_position(v_target, '', p_signal, p_payload, p_dedup_key,
                                                    p_signal_fingerprint, p_actor);
    IF p_dedup_key IS NOT NULL AND r.outcome = 'recorded' AND v_started THEN
        UPDATE {{schema}}.dedup x SET started_instance = true
        WHERE x.kind = 'SIGNAL' AND x.namespace = v_target::text AND x.key = p_dedup_key;
    ELSIF r.outcome = 'duplicate' THEN  -- this call again: it started the instance if its first attempt did
        v_started := COALESCE((SELECT x.started_instance FROM {{schema}}.dedup x
                               WHERE x.kind = 'SIGNAL' AND x.namespace = v_target::text
                                 AND x.key = p_dedup_key), false);
    END IF;
    RETURN QUERY SELECT r.outcome, v_target, v_started, r.command_id, r.status;
END $$;

CREATE FUNCTION {{schema}}.start_or_signal(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text, p_state jsonb,
    p_step text, p_business_key text, p_start_fingerprint text, p_actor text, p_signal text, p_payload jsonb,
    p_dedup_key text, p_signal_fingerprint text)
RETURNS TABLE (outcome text, instance_id uuid, started boolean, command_id bigint, status text)
LANGUAGE sql AS $$
    SELECT * FROM {{schema}}.start_or_signal_with(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state,
                                                  p_step, p_business_key, p_start_fingerprint, p_actor, p_signal,
                                                  p_payload, p_dedup_key, p_signal_fingerprint, NULL, NULL, NULL, NULL)
$$;

-- ==== version 22 (migration 0022_retention_filters) ====
-- A retention sweep can be narrowed to one workflow and/or one scope (`stepstone retention run
-- --workflow W --scope S`): the candidates of both phases are taken from those instances only. The
-- status is not a filter here: each status class has its window in the policies. The sweep of
-- migration 0009 becomes this one with neither.
CREATE FUNCTION {{schema}}.retention_batch(p_phase text, p_limit integer, p_after uuid, p_dry_run boolean,
                                           p_workflow text, p_scope text)
RETURNS TABLE (last_id uuid, scanned integer, done integer, busy integer, active integer, unsent integer,
               dead integer, done_ids uuid[])
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_min interval;
    v_cands uuid[];
    v_locked uuid[];
    v_free uuid[];
    v_idle uuid[];
    v_ok uuid[];
BEGIN
    IF p_phase NOT IN ('archive', 'purge') THEN
        RAISE EXCEPTION 'stepstone: unknown retention phase %', p_phase USING ERRCODE = '22023';
    END IF;
    PERFORM set_config('lock_timeout', '2s', true);
    -- The shortest window of any policy bounds the scan.
    SELECT min(CASE WHEN p_phase = 'archive' THEN r.retain_for ELSE r.purge_after END) INTO v_min
    FROM {{schema}}.retention_policies r
    WHERE r.status_class <> 'outbox_published' AND r.retain_for IS NOT NULL;
    IF v_min IS NULL THEN
        RETURN QUERY SELECT NULL::uuid, 0, 0, 0, 0, 0, 0, '{}'::uuid[];
        RETURN;
    END IF;
    IF p_phase = 'archive' THEN
        SELECT array_agg(x.id ORDER BY x.id) INTO v_cands FROM (
            SELECT i.id FROM {{schema}}.instances i
            CROSS JOIN LATERAL {{schema}}.retention_window(i.definition_id, {{schema}}.retention_class(i.status)) w
            WHERE (p_after IS NULL OR i.id > p_after)
              AND (p_workflow IS NULL OR i.definition_id = p_workflow) AND (p_scope IS NULL OR i.scope = p_scope)
              AND (i.archived_at IS NULL OR i.archived_at < COALESCE(i.ended_at, i.updated_at))
              AND COALESCE(i.ended_at, i.updated_at) < v_now - v_min
              AND COALESCE(i.ended_at, i.updated_at) < v_now - w.retain_for
            ORDER BY i.id LIMIT p_limit) x;
    ELSE
        SELECT array_agg(x.id ORDER BY x.id) INTO v_cands FROM (
            SELECT i.id FROM {{schema}}.instances i
            CROSS JOIN LATERAL {{schema}}.retention_window(i.definition_id, {{schema}}.retention_class(i.status)) w
            WHERE (p_after IS NULL OR i.id > p_after) AND i.archived_at IS NOT NULL
              AND (p_workflow IS NULL OR i.definition_id = p_workflow) AND (p_scope IS NULL OR i.scope = p_scope)
              AND i.archived_at >= COALESCE(i.ended_at, i.updated_at)
              AND i.archived_at < v_now - v_min
              AND i.archived_at < v_now - w.purge_after
              AND COALESCE(i.ended_at, i.updated_at) < v_now - w.retain_for
            ORDER BY i.id LIMIT p_limit) x;
    END IF;
    IF v_cands IS NULL THEN
        RETURN QUERY SELECT NULL::uuid, 0, 0, 0, 0, 0, 0, '{}'::uuid[];
        RETURN;
    END IF;
    -- The try-lock: rows a worker (or another sweep) holds are skipped, never waited for.
    SELECT array_agg(i.id ORDER BY i.id) INTO v_locked FROM (
        SELECT i.id FROM {{schema}}.instances i WHERE i.id = ANY (v_cands) ORDER BY i.id
        FOR UPDATE SKIP LOCKED) i;
    v_locked := COALESCE(v_locked, '{}');
    -- Busy: a position locked by a claim in progress (not all of them could be taken), or under a
    -- live lease. Set-based: one pass over the batch's positions.
    WITH taken AS (
        SELECT p.instance_id, p.lease_until FROM {{schema}}.positions p
        WHERE p.instance_id = ANY (v_locked) ORDER BY p.instance_id, p.path FOR UPDATE SKIP LOCKED
    ), got AS (
        SELECT t.instance_id, count(*) AS n, bool_or(t.lease_until > v_now) AS leased FROM taken t
        GROUP BY t.instance_id
    ), total AS (
        SELECT p.instance_id, count(*) AS n FROM {{schema}}.positions p
        WHERE p.instance_id = ANY (v_locked) GROUP BY p.instance_id
    )
    SELECT array_agg(l.id ORDER BY l.id) INTO v_free
    FROM unnest(v_locked) AS l(id)
    LEFT JOIN total ON total.instance_id = l.id
    LEFT JOIN got ON got.instance_id = l.id
    WHERE COALESCE(total.n, 0) = COALESCE(got.n, 0) AND NOT COALESCE(got.leased, false);
    v_free := COALESCE(v_free, '{}');
    -- Active: a command still to run, a child that has not ended (it reports to this instance; a FAILED
    -- or COMPENSATION_FAILED one may still, once retried; one that ended COMPENSATED or TIMED_OUT reports
    -- nothing more), or a parent that has not ended (it waits for this instance's end, or may again, once
    -- retried: a tree is swept from its root down, never a child from under a live parent).
    SELECT array_agg(f.id ORDER BY f.id) INTO v_idle FROM unnest(v_free) AS f(id)
    JOIN {{schema}}.instances i ON i.id = f.id
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.commands c
                      WHERE c.instance_id = f.id AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED'))
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.instances k
                      WHERE k.parent_id = f.id AND NOT {{schema}}.is_terminal(k.status))
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.instances u
                      WHERE u.id = i.parent_id AND NOT {{schema}}.is_terminal(u.status));
    v_idle := COALESCE(v_idle, '{}');
    -- Then, for a purge, events a consumer has not had.
    SELECT array_agg(f.id ORDER BY f.id) INTO v_ok FROM unnest(v_idle) AS f(id)
    WHERE p_phase = 'archive' OR NOT EXISTS (SELECT 1 FROM {{schema}}.outbox o
                                             WHERE o.instance_id = f.id AND o.published_at IS NULL);
    v_ok := COALESCE(v_ok, '{}');
    last_id := v_cands[cardinality(v_cands)];
    scanned := cardinality(v_cands);
    done := cardinality(v_ok);
    busy := cardinality(v_cands) - cardinality(v_free);
    active := cardinality(v_free) - cardinality(v_idle);
    unsent := 0;
    dead := 0;
    IF p_phase = 'purge' THEN
        SELECT count(*) FILTER (WHERE NOT h.has_dead), count(*) FILTER (WHERE h.has_dead) INTO unsent, dead
        FROM (SELECT f.id, bool_or(o.dead_at IS NOT NULL) AS has_dead
              FROM unnest(v_idle) AS f(id)
              JOIN {{schema}}.outbox o ON o.instance_id = f.id AND o.published_at IS NULL
              GROUP BY f.id) h;
    END IF;
    done_ids := v_ok;
    IF NOT p_dry_run AND cardinality(v_ok) > 0 THEN
        IF p_phase = 'archive' THEN
            UPDATE {{schema}}.instances i SET archived_at = v_now WHERE i.id = ANY (v_ok);
        ELSE
            DELETE FROM {{schema}}.positions p WHERE p.instance_id = ANY (v_ok);
            DELETE FROM {{schema}}.commands c WHERE c.instance_id = ANY (v_ok);
            DELETE FROM {{schema}}.dedup d
            WHERE (d.kind = 'START' AND d.target = ANY (v_ok::text[]))
               OR (d.kind = 'SIGNAL' AND d.namespace = ANY (v_ok::text[]));
            DELETE FROM {{schema}}.history h WHERE h.instance_id = ANY (v_ok);
            DELETE FROM {{schema}}.instances i WHERE i.id = ANY (v_ok);
        END IF;
    END IF;
    RETURN NEXT;
END $$;

CREATE FUNCTION {{schema}}.retention_batch(p_phase text, p_limit integer, p_after uuid, p_dry_run boolean)
RETURNS TABLE (last_id uuid, scanned integer, done integer, busy integer, active integer, unsent integer,
               dead integer, done_ids uuid[])
LANGUAGE sql AS $$
    SELECT * FROM {{schema}}.retention_batch(p_phase, p_limit, p_after, p_dry_run, NULL, NULL)
$$;

-- ==== version 23 (migration 0023_start_batches) ====
-- Batch starts: many instances of one workflow version in one statement (Client.start_many).
--
-- A start writes five rows and fires a trigger per row that checks the pin (instances_admit_pin),
-- redacts the baseline history (history_redact_baseline), applies flow limits (commands_flow_start,
-- at commit) and wakes the workers (commands_notify). For a batch all of that is the same for every
-- row, so start_batch does it once and tells those triggers to skip the rows it wrote, through the
-- transaction-local setting `stepstone.batch` (a list of words, reset before the function returns):
--   admitted   the pin was admitted once for the batch (definition_scope is set on every row)
--   notified   one notification for the batch instead of one per START command
--   plain      the plan has no sensitive paths: the baseline has nothing to redact
-- A word is set only when the batch did that work or there is none to do; otherwise the trigger runs
-- for each row as for a single start. Flow limits stay per row: a constraint trigger cannot be
-- replaced in place (CREATE OR REPLACE refuses it, and migrations do not DROP), so flow_on_start only
-- reads the clock after it found a limit. Measured on the local PostgreSQL 15 (10,000 starts in one
-- statement): the four triggers took 300 of 650 ms (docs/performance-history.md, "Batch starts").

-- The admission check of instances_admit_pin, callable once for a batch: the scope whose registration
-- the pin uses (the instance's own or 'default'), NULL when the workflow is registered nowhere (an
-- instance of an unregistered workflow is allowed, as before); raises as the trigger does otherwise.
CREATE FUNCTION {{schema}}.admitted_scope(p_definition text, p_version integer, p_plan_hash text, p_scope text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_row record;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1936028530, {{schema}}.define_lock_key(p_definition));
    SELECT d.scope, d.status, d.plan_hash INTO v_row
    FROM {{schema}}.definitions d
    WHERE d.definition_id = p_definition AND d.version = p_version AND d.scope IN (p_scope, 'default')
    ORDER BY (d.scope = p_scope) DESC
    LIMIT 1;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.definitions d WHERE d.definition_id = p_definition) THEN
            RAISE EXCEPTION USING ERRCODE = 'SSR01',
                MESSAGE = format('workflow %s v%s is not registered in scope %s or default',
                                 p_definition, p_version, p_scope);
        END IF;
        RETURN NULL;
    END IF;
    IF v_row.plan_hash <> p_plan_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'SSR02',
            MESSAGE = format('workflow %s v%s: the pin has plan %s but scope %s registered plan %s '
                             '(the structure changed without a version bump)',
                             p_definition, p_version, left(p_plan_hash, 12), v_row.scope, left(v_row.plan_hash, 12));
    END IF;
    IF v_row.status <> 'AVAILABLE' THEN
        RAISE EXCEPTION USING ERRCODE = 'SSR01',
            MESSAGE = format('workflow %s v%s is %s in scope %s; only an AVAILABLE version takes new instances',
                             p_definition, p_version, v_row.status, v_row.scope);
    END IF;
    RETURN v_row.scope;
END $$;

-- admit_pin changes here; its one definition is in the version 8 section.

-- Each trigger below reads the setting inline: a trigger's WHEN is not planned, so a SQL function there
-- would be run through the function manager for every row (no inlining), which costs more than the
-- comparison. The words share no substrings, so strpos finds exactly the word asked for.
CREATE OR REPLACE TRIGGER instances_admit_pin
    BEFORE INSERT OR UPDATE OF definition_id, version, plan_hash, scope ON {{schema}}.instances
    FOR EACH ROW WHEN (strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'admitted') = 0) EXECUTE FUNCTION {{schema}}.admit_pin();

-- A migration's baseline (INSTANCE_MIGRATED, whose state is the full new state) is redacted the same way,
-- at the paths of the version it migrated to (the instance row already names it when the entry is written).
CREATE OR REPLACE TRIGGER history_redact_baseline
    BEFORE INSERT ON {{schema}}.history
    FOR EACH ROW WHEN (NEW.kind IN ('INSTANCE_STARTED', 'INSTANCE_MIGRATED') AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'plain') = 0)
    EXECUTE FUNCTION {{schema}}.redact_baseline();

CREATE OR REPLACE TRIGGER commands_notify
    AFTER INSERT OR UPDATE OF state, available_at ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED') AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'notified') = 0)
    EXECUTE FUNCTION {{schema}}.notify_command();

-- Start many instances of one pinned version in one statement. Per item (arrays of one length): the
-- new id, the state, the business key, the idempotency key and its fingerprint; for all: the scope,
-- the start step, the actor, the caller's durable context and the deadlines (as start_with_context and
-- schedule_start_deadlines take them). The batch is one transaction: every item starts or none does.
-- A business key in use fails the statement (unique_violation), and so does an idempotency key used
-- before with other input (SSK01, DETAIL the instance it started), by an earlier call or by an earlier
-- item of this batch. Returns one row per item, in input order (idx from 1): the instance id (the
-- earlier one for a key used before with the same input) and whether this call created it.
CREATE FUNCTION {{schema}}.start_batch(
    p_ids uuid[], p_scope text, p_definition text, p_version integer, p_plan_hash text, p_states jsonb[],
    p_step text, p_business_keys text[], p_keys text[], p_fingerprints text[], p_actor text, p_context jsonb,
    p_deadline_at timestamptz, p_deadline_seconds float8, p_start_deadline_seconds float8)
RETURNS TABLE (idx integer, instance_id uuid, created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_scope text;
    v_paths jsonb;
    v_words text[] := ARRAY['admitted', 'notified'];
    v_created uuid[];
    v_clash record;
BEGIN
    PERFORM set_config('stepstone.actor', COALESCE(p_actor, ''), true);
    v_scope := {{schema}}.admitted_scope(p_definition, p_version, p_plan_hash, p_scope);
    -- The same lookup as redact_baseline's: nothing to redact, nothing the trigger would change.
    SELECT d.plan -> 'sensitive' INTO v_paths FROM {{schema}}.definitions d
    WHERE d.scope = COALESCE(v_scope, p_scope) AND d.definition_id = p_definition AND d.version = p_version;
    IF v_paths IS NULL OR jsonb_typeof(v_paths) <> 'array' OR jsonb_array_length(v_paths) = 0 THEN
        v_words := v_words || 'plain'::text;
    END IF;
    PERFORM set_config('stepstone.batch', array_to_string(v_words, ','), true);

    WITH input AS MATERIALIZED (
        SELECT t.id, t.state, t.business_key, t.key, t.fingerprint
        FROM unnest(p_ids, p_states, p_business_keys, p_keys, p_fingerprints)
             AS t(id, state, business_key, key, fingerprint)
    ), keyed AS (
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        SELECT 'START', p_scope || '/' || p_definition, input.key, input.fingerprint, input.id::text, v_now
        FROM input WHERE input.key IS NOT NULL
        ON CONFLICT DO NOTHING
        RETURNING target
    ), go AS MATERIALIZED (
        SELECT input.* FROM input WHERE input.key IS NULL OR input.id::text IN (SELECT target FROM keyed)
    ), inst AS (
        INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, definition_scope, status,
                                          state, step, visit, business_key, next_seq, history_seq, context,
                                          created_at, updated_at)
        SELECT go.id, p_scope, p_definition, p_version, p_plan_hash, v_scope, 'PENDING', go.state, p_step, 1,
               go.business_key, 2, 1, p_context, v_now, v_now FROM go
        RETURNING id
    ), pos AS (
        INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
        SELECT go.id, '', 'RUNNING', p_step, 1, v_now, v_now FROM go
    ), cmd AS (
        INSERT INTO {{schema}}.commands (instance_id, definition, seq, kind, state, step, visit, dedup_key,
                                         available_at, created_at)
        SELECT go.id, p_definition, 1, 'START', 'PENDING', p_step, 1, go.key, v_now, v_now FROM go
    ), hist AS (
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
        SELECT go.id, 1, v_now, 'INSTANCE_STARTED', p_step, 1, p_actor,
               jsonb_build_object('state', go.state) FROM go
    )
    SELECT array_agg(inst.id) FROM inst INTO v_created;
    PERFORM set_config('stepstone.batch', '', true);

    IF p_deadline_at IS NOT NULL OR p_deadline_seconds IS NOT NULL OR p_start_deadline_seconds IS NOT NULL THEN
        PERFORM {{schema}}.schedule_start_deadlines(c.id, p_deadline_at, p_deadline_seconds, p_step,
                                                    p_start_deadline_seconds)
        FROM unnest(v_created) AS c(id);
    END IF;
    IF v_created IS NOT NULL THEN
        PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                           WHERE c.oid = '{{schema}}.commands'::regclass),
                          (extract(epoch FROM v_now) * 1000)::bigint::text || ':' || p_definition);
    END IF;

    -- A statement of its own, so it sees the keys this batch wrote too.
    SELECT t.key, d.target INTO v_clash
    FROM unnest(p_ids, p_keys, p_fingerprints) AS t(id, key, fingerprint)
    JOIN {{schema}}.dedup d ON d.kind = 'START' AND d.namespace = p_scope || '/' || p_definition AND d.key = t.key
    WHERE d.target <> t.id::text AND d.fingerprint <> t.fingerprint
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'SSK01', DETAIL = v_clash.target,
            MESSAGE = format('idempotency key %L already started instance %s with different input',
                             v_clash.key, v_clash.target);
    END IF;

    RETURN QUERY
    SELECT t.n::integer, COALESCE(c.id, d.target::uuid, t.id), c.id IS NOT NULL
    FROM unnest(p_ids, p_keys) WITH ORDINALITY AS t(id, key, n)
    LEFT JOIN unnest(v_created) AS c(id) ON c.id = t.id
    LEFT JOIN {{schema}}.dedup d
           ON c.id IS NULL AND d.kind = 'START' AND d.namespace = p_scope || '/' || p_definition AND d.key = t.key
    ORDER BY t.n;
END $$;


-- flow_on_start changes here; its one definition is in the version 11 section.

-- redact_baseline changes here; its one definition is in the version 9 section.

-- ==== version 24 (migration 0024_commands_fillfactor) ====
-- Commands fill their pages. Their rows are never updated in place (HOT): every claim and settle
-- changes `state`, which the queue's partial indexes read, so the 30% of each page that fillfactor 70
-- kept free for such updates was never used (0 of 8,800 command updates HOT after 2,000 three-step
-- workflows, docs/performance-history.md, "Hot-path changes and their measured effect"), and a waiting
-- instance's settled START and pending TIMER carried that slack on disk. New pages are filled; existing
-- ones keep their layout until rewritten.
ALTER TABLE {{schema}}.commands SET (fillfactor = 100);

-- ==== version 25 (migration 0025_migration_keeps_join_progress) ====
-- migrate_instance changes here; its one definition is in the version 8 section.

-- ==== version 26 (migration 0026_drop_superseded_queue_index) ====
-- The per-instance queue index of version 1 (commands_queue) is gone: commands_position_queue
-- (version 2) serves every queue read. The migration drops it CONCURRENTLY, outside a transaction.

-- ==== version 27 (migration 0027_ascending_listing_indexes) ====
-- The listing indexes of instances (instances_created, instances_status_created, instances_scope_created,
-- instances_definition_created) are ascending and read backwards for newest-first listings: new entries
-- land at their right edge, whose pages split 90/10, where descending ones left half-empty pages. They
-- replaced the *_newest indexes of versions 1, 8 and 9, built and dropped CONCURRENTLY.

-- ==== version 29 (migration 0029_fewer_trigger_conditions) ====
-- One trigger for what a change of an instance's status does (the four it replaced are disabled: migrations
-- do not drop), and the wake-up of a command made ready by an update without the batch test. Each
-- trigger's WHEN is read back and prepared for every statement that may fire it (see the migration).
CREATE FUNCTION {{schema}}.instance_status_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Once a saga has begun only the saga decides the status, and an instance that completed or was
    -- cancelled keeps its status, unless this update reopens it: it sets or clears ended_at (a replay,
    -- a saga compensating a completed child), or a live saga moves to one of its own statuses.
    IF (OLD.saga IS NOT NULL
        OR (OLD.status IN ('COMPLETED', 'CANCELLED') AND NEW.ended_at IS NOT DISTINCT FROM OLD.ended_at))
       AND NOT (OLD.ended_at IS NULL AND (NEW.status IN ('COMPENSATING', 'COMPENSATION_FAILED')
                                          OR NEW.ended_at IS DISTINCT FROM OLD.ended_at)) THEN
        NEW.status := OLD.status;
        RETURN NEW;
    END IF;
    -- wait_for returns on these. Sent from a BEFORE trigger, as this update's last word on the row: a
    -- notification is delivered only if the transaction (and any savepoint around the update) commits.
    IF NEW.status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT', 'COMPENSATION_FAILED') THEN
        PERFORM pg_notify(left('stepstone.settled.' || TG_TABLE_SCHEMA, 63), NEW.id::text);
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER instances_status_changed
    BEFORE UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.instance_status_changed();

ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_keep_saga_status;
ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_keep_ended_status;
ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_notify_settled;
ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_notify_saga_settled;

CREATE OR REPLACE TRIGGER commands_notify
    AFTER INSERT ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED') AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'notified') = 0)
    EXECUTE FUNCTION {{schema}}.notify_command();

CREATE TRIGGER commands_notify_requeued
    AFTER UPDATE OF state, available_at ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED'))
    EXECUTE FUNCTION {{schema}}.notify_command();

-- ==== version 30 (migration 0030_continuation_in_place) ====
-- commit_decision (in the version 5 section) goes on in the claimed command's row when a step's own
-- command (START, STEP, RETRY) continues to the next step, instead of settling it and inserting another.

-- ==== version 31 (migration 0031_waiting_rows_fill_pages) ====
-- Waiting instances fill more of their pages: a fifth of each page left free still holds one more version
-- of any row kept in line (none is above about 2 KB), so updates stay HOT as often as at fillfactor 70,
-- and the rest of the slack no longer follows every waiting instance on disk (docs/performance-history.md,
-- "Waiting rows fill more of their pages").
ALTER TABLE {{schema}}.instances SET (fillfactor = 80);
ALTER TABLE {{schema}}.positions SET (fillfactor = 80);

-- ==== version 32 (migration 0032_stored_once) ====
-- What an instance waits for is stored once, on its root position: commit_decision and migrate_instance
-- (in the version 5 and 25 sections) no longer copy it into instances.wait. The start entry's data is the
-- baseline state alone (and a child's parent): the pin an instance started on is its row's, or the first
-- INSTANCE_MIGRATED entry's `from_version` and `from_plan_hash` (start_children, start_instance and
-- start_batch in the version 2, 12 and 23 sections).

-- ==== version 33 (migration 0033_deferred_not_runnable_index) ====
-- Commands deferred because the workers that claimed them lacked the plan, found by resume_deferred at
-- every heartbeat without reading the pending timers of waiting instances in commands_ready.
CREATE INDEX commands_not_runnable ON {{schema}}.commands (available_at, id)
    WHERE state = 'DEFERRED' AND last_error LIKE 'NOT\_RUNNABLE%';

-- ==== version 34 (migration 0034_documents_without_statistics) ====
-- Documents carry no column statistics: no statement filters, joins or sorts on one, and sorting jsonb
-- for a histogram was most of an ANALYZE of history.
ALTER TABLE {{schema}}.instances ALTER COLUMN state SET STATISTICS 0,
                                 ALTER COLUMN wait SET STATISTICS 0,
                                 ALTER COLUMN error SET STATISTICS 0,
                                 ALTER COLUMN saga SET STATISTICS 0,
                                 ALTER COLUMN context SET STATISTICS 0;
ALTER TABLE {{schema}}.positions ALTER COLUMN wait SET STATISTICS 0,
                                 ALTER COLUMN error SET STATISTICS 0,
                                 ALTER COLUMN item SET STATISTICS 0;
ALTER TABLE {{schema}}.commands ALTER COLUMN payload SET STATISTICS 0,
                                ALTER COLUMN context SET STATISTICS 0;
ALTER TABLE {{schema}}.history ALTER COLUMN data SET STATISTICS 0;

-- ==== version 35 (migration 0035_timer_in_place) ====
-- commit_decision (in the version 5 section) turns the claimed command of a step's own (START, STEP,
-- RETRY) into the timer it queues first on its position when the step ends in a timed wait, instead of
-- settling it and inserting the timer.

-- ==== version 36 (migration 0036_claim_on_its_generic_plan) ====
-- The claim (queries.sql, `claim`, calls it) runs on its generic plan on every call, whatever custom
-- plans the connection made before; the statement and why each part of it is so: the migration's header.
CREATE FUNCTION {{schema}}.claim_heads(p_batch integer, p_lease_seconds double precision, p_worker text,
                                       p_served text[])
RETURNS TABLE (command_id bigint, kind text, command_step text, command_visit integer, name text,
               payload jsonb, attempt integer, claims integer, token uuid, last_error text, actor text,
               instance_id uuid, scope text, definition_id text, version integer, plan_hash text,
               status text, state jsonb, state_version bigint, business_key text, parent_id uuid,
               parent_position text, parent_visit integer, "position" text, position_status text,
               step text, visit integer, wait jsonb, branch_parent text, branch_visit integer,
               branch_name text, branch_item jsonb, context jsonb, instance_created_at timestamptz,
               now timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH clock AS MATERIALIZED (
        -- served: the keys of the work this claim takes, the worker's definition ids and the routes of its pins
        -- (version 76), or from a worker of an earlier release (its ids alone: no key holds '@') those ids and
        -- their routes, which it took work of before; walk: the served ids and those served routes that hold
        -- ready commands, or every key that has ready work. Whether a route holds any is a probe of
        -- commands_routed (version 85), after one probe that finds the index empty when nothing is routed:
        -- no probe of commands_ready for a route that holds nothing (the predicate's two tests, as written in
        -- the index, are what let these read it)
        SELECT {{schema}}.db_now() AS now, p_batch AS batch, s.served,
               CASE WHEN s.served IS NULL THEN {{schema}}.ready_definitions()
                    ELSE ARRAY(SELECT u.k FROM unnest(s.served) WITH ORDINALITY AS u(k, n)
                               WHERE strpos(u.k, '@') = 0
                                  OR ((SELECT c.definition FROM {{schema}}.commands c
                                       WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                                         AND strpos(c.definition, '@') > 0
                                       ORDER BY c.definition LIMIT 1) IS NOT NULL
                                      AND (SELECT c.definition FROM {{schema}}.commands c
                                           WHERE c.definition = u.k AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                                             AND strpos(c.definition, '@') > 0
                                           ORDER BY c.definition LIMIT 1) IS NOT NULL)
                               ORDER BY u.n) END AS walk
        FROM (SELECT CASE WHEN strpos(array_to_string(p_served, ' '), '@') > 0 THEN p_served
                          ELSE {{schema}}.served_with_routes(p_served) END AS served) AS s
    ), expired AS (
        SELECT c.id, c.instance_id, c.position, c.available_at, gen_random_uuid() AS token
        FROM {{schema}}.commands c
        JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
        WHERE c.state = 'CLAIMED'
          AND c.available_at <= (SELECT clock.now FROM clock)
          AND (p.lease_until IS NULL OR p.lease_until <= (SELECT clock.now FROM clock))
          AND NOT EXISTS (
              SELECT 1 FROM {{schema}}.commands e
              WHERE e.instance_id = c.instance_id AND e.position = c.position
                AND e.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                AND (e.seq, e.id) < (c.seq, c.id)
                AND NOT (e.kind = 'TIMER' AND e.available_at > (SELECT clock.now FROM clock))
              OFFSET 0)  -- a lookup per candidate, never an anti-join (see above)
          AND ((SELECT clock.served FROM clock) IS NULL
               OR c.definition = ANY ((SELECT clock.served FROM clock)::text[]))  -- an array, not a subquery to ANY
        ORDER BY c.available_at, c.id
        LIMIT (SELECT clock.batch FROM clock)
        FOR UPDATE OF p SKIP LOCKED
    ), ready AS (
        -- Ready work of the walked definitions, each one's own walk through commands_ready, so
        -- that another workflow's backlog is never read. The definition whose oldest ready command is the
        -- oldest is walked first, then the next, until the batch is full: a walk locks no more positions
        -- than the claim keeps (the ones it skips aside), however many definitions the worker serves.
        SELECT r.id, r.instance_id, r.position, r.available_at, r.token
        FROM (
            SELECT s.definition_id, h.available_at
            FROM unnest((SELECT clock.walk FROM clock)::text[]) AS s(definition_id)
            CROSS JOIN LATERAL (
                SELECT c.available_at FROM {{schema}}.commands c
                WHERE c.definition = s.definition_id
                  AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
                  AND c.available_at <= (SELECT clock.now FROM clock)
                ORDER BY c.available_at, c.id
                LIMIT 1
            ) AS h
            ORDER BY h.available_at
        ) AS d
        CROSS JOIN LATERAL (
            SELECT c.id, c.instance_id, c.position, c.available_at, gen_random_uuid() AS token
            FROM {{schema}}.commands c
            JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
            WHERE c.definition = d.definition_id
              AND (c.state IN ('PENDING', 'DEFERRED')) IS TRUE
              AND c.available_at <= (SELECT clock.now FROM clock)
              AND (p.lease_until IS NULL OR p.lease_until <= (SELECT clock.now FROM clock))
              AND NOT EXISTS (
                  SELECT 1 FROM {{schema}}.commands e
                  WHERE e.instance_id = c.instance_id AND e.position = c.position
                    AND e.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                    AND (e.seq, e.id) < (c.seq, c.id)
                    AND NOT (e.kind = 'TIMER' AND e.available_at > (SELECT clock.now FROM clock))
                  OFFSET 0)
            ORDER BY c.available_at, c.id
            LIMIT (SELECT clock.batch FROM clock)
            FOR UPDATE OF p SKIP LOCKED
        ) AS r
        LIMIT (SELECT clock.batch FROM clock)
    ), cand AS (
        -- A plain LIMIT in each branch keeps its plan an index scan; the union is cut here.
        SELECT * FROM (SELECT * FROM expired UNION ALL SELECT * FROM ready)
            AS every_kind LIMIT (SELECT clock.batch FROM clock)
    ), claimed AS (
        UPDATE {{schema}}.commands c SET
            state = 'CLAIMED',
            token = cand.token,
            available_at = (SELECT clock.now FROM clock) + make_interval(secs => p_lease_seconds),
            claimed_by = p_worker,
            claims = c.claims + 1
        FROM cand
        WHERE c.id = cand.id
          -- IS TRUE (see the head of queries.sql): a plan made when ANALYZE found the queue empty read the whole
          -- of commands_position_queue for every candidate here.
          AND (c.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE
          AND c.available_at <= (SELECT clock.now FROM clock)
        RETURNING c.id, c.instance_id, c.position, c.kind, c.step, c.visit, c.name, c.payload, c.attempt, c.claims,
                  c.token, c.last_error, c.actor, c.context, cand.available_at AS queued_at
    ), leased AS (
        UPDATE {{schema}}.positions p SET
            lease_token = claimed.token,
            lease_until = (SELECT clock.now FROM clock) + make_interval(secs => p_lease_seconds),
            lease_owner = p_worker
        FROM claimed
        WHERE p.instance_id = claimed.instance_id AND p.path = claimed.position
        RETURNING p.instance_id, p.path, p.status, p.step, p.visit, p.wait, p.parent_path, p.parent_visit, p.name,
                  p.item
    )
    SELECT claimed.id AS command_id, claimed.kind, claimed.step AS command_step, claimed.visit AS command_visit,
           claimed.name, claimed.payload, claimed.attempt, claimed.claims, claimed.token, claimed.last_error,
           claimed.actor,
           i.id AS instance_id, i.scope, i.definition_id, i.version, i.plan_hash, i.status, i.state,
           i.state_version, i.business_key, i.parent_id, i.parent_position, i.parent_visit,
           leased.path AS position, leased.status AS position_status, leased.step, leased.visit, leased.wait,
           leased.parent_path AS branch_parent, leased.parent_visit AS branch_visit, leased.name AS branch_name,
           leased.item AS branch_item, COALESCE(claimed.context, i.context) AS context, i.created_at AS instance_created_at,
           (SELECT clock.now FROM clock) AS now
    FROM claimed
    JOIN leased ON leased.instance_id = claimed.instance_id AND leased.path = claimed.position
    JOIN {{schema}}.instances i ON i.id = claimed.instance_id
    -- In the order they became claimable (available_at before this claim: an expired lease's is when it ran
    -- out): the worker runs the first suspect alone and gives the others back (runtime/alone.py, migration 0067).
    ORDER BY claimed.queued_at, claimed.id;
END $$;

-- ==== version 37 (migration 0037_joins_take_queued_reports) ====
-- commit_decision (in the version 5 section) settles the branch reports a join's decision carried out
-- with the one it claimed (SettleQueued), and returns the current state to a decision that wrote none on
-- a version that has moved on since; why: the migration's header.

-- ==== version 38 (migration 0038_commands_know_their_definition) ====
-- Every command carries its instance's definition id: the starts and commit_decision name it (in their
-- sections above), a trigger fills it for every other insert, and the wake-up notifications name it
-- (notify_command, commit_decision and start_batch, in their sections above); why: the migration's header.
ALTER TABLE {{schema}}.commands ADD COLUMN definition text;
ALTER TABLE {{schema}}.commands ALTER COLUMN definition SET STATISTICS 0;

CREATE FUNCTION {{schema}}.command_definition() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT i.definition_id INTO NEW.definition FROM {{schema}}.instances i WHERE i.id = NEW.instance_id;
    IF NEW.definition IS NULL THEN
        RAISE EXCEPTION 'a command of instance % that does not exist', NEW.instance_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER commands_definition BEFORE INSERT ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.definition IS NULL) EXECUTE FUNCTION {{schema}}.command_definition();

-- ==== version 39 (migration 0039_commands_ready_by_definition) ====
-- Its index, commands_ready_definition, is gone since version 43 (commands_ready, version 41, took its
-- place).

-- ==== version 40 (migration 0040_claims_walk_their_own_definitions) ====
-- claim_heads (in the version 36 section) walks each served definition's ready commands on its own;
-- why: the migration's header.

-- ==== version 41 (migration 0041_ready_index_by_definition) ====
-- The ready commands of each definition, oldest first: the one index of ready work, read by the walks
-- that state `(state IN ('PENDING', 'DEFERRED')) IS TRUE` and by nothing else (why: the migration's
-- header). It replaced commands_ready (available_at, id) of version 1, built CONCURRENTLY.
CREATE INDEX commands_ready ON {{schema}}.commands (definition, available_at, id)
    WHERE (state IN ('PENDING', 'DEFERRED')) IS TRUE;

-- ==== version 42 (migration 0042_ready_commands_indexed_once) ====
-- claim_heads (in the version 36 section), next_available and the health sample walk commands_ready, and
-- the definitions that have ready commands when they are given none; why: the migration's header.
-- The definitions that have PENDING or DEFERRED commands, in order: one probe of commands_ready a
-- definition (each finds the first entry past the last one found), however many commands each one holds.
CREATE FUNCTION {{schema}}.ready_definitions() RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    -- plpgsql, not sql: a SQL function's statement is planned anew on every call (0.3 ms a claim).
    RETURN (
        WITH RECURSIVE d AS (
            (SELECT c.definition FROM {{schema}}.commands c
             WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND c.definition IS NOT NULL
             ORDER BY c.definition LIMIT 1)
            UNION ALL
            SELECT (SELECT c.definition FROM {{schema}}.commands c
                    WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND c.definition > d.definition
                    ORDER BY c.definition LIMIT 1)
            FROM d WHERE d.definition IS NOT NULL
        )
        SELECT COALESCE(array_agg(d.definition), '{}') FROM d WHERE d.definition IS NOT NULL);
END $$;

-- ==== version 43 (migration 0043_drop_commands_ready_definition) ====
-- The contract step of version 41: commands_ready_definition (version 39) is gone, since commands_ready
-- serves every walk of ready work. The migration drops it CONCURRENTLY, outside a transaction.

-- ==== version 44 (migration 0044_every_end_is_an_end) ====
-- migrate_instance skips, and signal_position refuses, an instance that ended COMPENSATED or TIMED_OUT
-- too; why: the migration's header.
-- The ends an instance cannot leave, in one place for the statements that ask (core.model.TERMINAL;
-- tests/test_schema_matches_migrations.py checks the two agree).
CREATE FUNCTION {{schema}}.is_terminal(p_status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_status IN ('COMPLETED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT') $$;

-- migrate_instance changes here; its one definition is in the version 8 section.

-- signal_position changes here; its one definition is in the version 2 section.

-- ==== version 45 (migration 0045_one_test_of_archived) ====
-- One test of "archived", for every list and count: why, the migration's header.
CREATE FUNCTION {{schema}}.is_archived(p_archived_at timestamptz, p_ended_at timestamptz,
                                       p_updated_at timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_archived_at IS NOT NULL AND p_archived_at >= COALESCE(p_ended_at, p_updated_at) $$;

-- ==== version 46 (migration 0046_failed_branches_and_their_joins) ====
-- Whether the failed positions of an instance stop it (docs/branches.md, "A branch that fails"). A FAILED
-- position is dead; a fork position waiting at its join is dead when fewer of its branches than the join
-- needs are running, waiting or arrived (COMPLETED) and not dead themselves, so that a branch whose own
-- join can no longer be met counts as failed for the join above it. The instance stops when its root is
-- dead. A join that needs every branch is never met once one has failed. Asked only when a position has
-- failed; each round looks one level further up.
CREATE FUNCTION {{schema}}.failures_stop(p_instance uuid) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_dead text[] := ARRAY(SELECT p.path FROM {{schema}}.positions p
                           WHERE p.instance_id = p_instance AND p.status = 'FAILED');
    v_more text[];
BEGIN
    LOOP
        IF '' = ANY (v_dead) THEN
            RETURN true;
        END IF;
        v_more := ARRAY(
            SELECT f.path FROM {{schema}}.positions f
            WHERE f.instance_id = p_instance AND f.status = 'WAITING' AND f.wait->>'kind' = 'join'
              AND NOT f.path = ANY (v_dead)
              AND EXISTS (SELECT 1 FROM {{schema}}.positions c
                          WHERE c.instance_id = p_instance AND c.parent_path = f.path AND c.parent_visit = f.visit
                            AND c.path = ANY (v_dead))
              AND (SELECT count(*) FROM {{schema}}.positions c
                   WHERE c.instance_id = p_instance AND c.parent_path = f.path AND c.parent_visit = f.visit
                     AND c.status IN ('RUNNING', 'WAITING', 'COMPLETED') AND NOT c.path = ANY (v_dead))
                  < (f.wait->>'need')::integer);
        IF cardinality(v_more) = 0 THEN
            RETURN false;
        END IF;
        v_dead := v_dead || v_more;
    END LOOP;
END $$;

-- ==== version 47 (migration 0047_branch_first_step_deadlines) ====
-- schedule_step_deadlines changes here; its one definition is in the version 6 section.

-- ==== version 48 (migration 0048_children_already_ended) ====
-- start_children changes here; its one definition is in the version 2 section.

-- ==== version 49 (migration 0049_task_fixes) ====
-- close_position_waits (with the tasks' functions above) cancels a cancelled position's external tasks
-- too, and answer_external_task (with the external tasks' functions above) records a retried failure in
-- the history and knows a retried failure sent again (released_token); why: the migration's header.
-- A deleted instance takes its tasks, their keys and its subscriptions with it (instances_deleted).
ALTER TABLE {{schema}}.external_tasks ADD COLUMN released_token uuid;

-- An instance's task rows (human and external, with the data they show and the payloads of their
-- answers), the idempotency keys of its tasks' operations, its message subscriptions and its compensation
-- records (what its saga steps kept to undo) go with it when it is deleted (retention's purge), as its
-- positions, commands and history do.
CREATE FUNCTION {{schema}}.instances_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {{schema}}.dedup d USING {{schema}}.tasks k, gone g
    WHERE k.instance_id = g.id AND d.kind IN ('TASK_OP', 'TASK_COMPLETE') AND d.namespace = k.id::text;
    DELETE FROM {{schema}}.tasks k USING gone g WHERE k.instance_id = g.id;
    DELETE FROM {{schema}}.external_tasks x USING gone g WHERE x.instance_id = g.id;
    DELETE FROM {{schema}}.subscriptions s USING gone g WHERE s.instance_id = g.id;
    DELETE FROM {{schema}}.compensations k USING gone g WHERE k.instance_id = g.id;
    RETURN NULL;
END $$;

CREATE TRIGGER instances_deleted
    AFTER DELETE ON {{schema}}.instances REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.instances_deleted();

-- ==== version 50 (migration 0050_saga_tour_fixes) ====
-- Compensations given up are owed again by every later round of a saga; why: the migration's header.
-- The compensations of an instance given up (FAILED) are owed again (PENDING), in ascending id order.
CREATE FUNCTION {{schema}}.saga_owe_given_up(p_instance uuid)
RETURNS void
LANGUAGE sql AS $$
    UPDATE {{schema}}.compensations k SET status = 'PENDING'
    WHERE k.id IN (SELECT y.id FROM {{schema}}.compensations y
                   WHERE y.instance_id = p_instance AND y.status = 'FAILED' ORDER BY y.id FOR UPDATE);
$$;

-- saga_begin changes here; its one definition is in the version 6 section.

-- retry_saga changes here; its one definition is in the version 6 section.

-- compensate_child changes here; its one definition is in the version 6 section.

-- advance_saga changes here; its one definition is in the version 6 section.

-- A schedule's tick gives the instance it starts the workflow's deadlines, as a start does
-- (docs/schedules.md, docs/sagas.md "Deadlines"). fire_schedule started instances that never timed
-- out: neither the workflow's default instance deadline nor its action start step's deadline was
-- scheduled, which client starts and start_or_signal do (schedule_start_deadlines). The firing worker
-- passes both (it has the workflow); a worker of before calls the eight-argument form, which is now
-- the same function without deadlines.
CREATE FUNCTION {{schema}}.fire_schedule(
    p_name text, p_expected timestamptz, p_next timestamptz, p_ticks jsonb,
    p_version integer, p_plan_hash text, p_step text, p_state jsonb,
    p_deadline_seconds float8, p_start_deadline_seconds float8)
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
            PERFORM {{schema}}.schedule_start_deadlines(v_id, NULL, p_deadline_seconds, p_step,
                                                        p_start_deadline_seconds);
            v_fired := v_fired + 1;
            v_last := v_id;
            RETURN QUERY SELECT 'started'::text, v_id, t.tick;
        END IF;
    END LOOP;
    UPDATE {{schema}}.schedules s SET next_fire_at = p_next, last_tick = v_tick, last_instance = v_last,
        fired = s.fired + v_fired, skipped = s.skipped + v_skipped, updated_at = {{schema}}.db_now()
    WHERE s.name = p_name;
END $$;

CREATE FUNCTION {{schema}}.fire_schedule(
    p_name text, p_expected timestamptz, p_next timestamptz, p_ticks jsonb,
    p_version integer, p_plan_hash text, p_step text, p_state jsonb)
RETURNS TABLE (outcome text, instance_id uuid, tick timestamptz)
LANGUAGE sql AS $$
    SELECT * FROM {{schema}}.fire_schedule(p_name, p_expected, p_next, p_ticks, p_version, p_plan_hash, p_step,
                                           p_state, NULL::float8, NULL::float8);
$$;

-- start_children changes here; its one definition is in the version 2 section.

-- replay_instance changes here; its one definition is in the version 9 section.

-- saga_next changes here; its one definition is in the version 6 section.

-- ==== version 51 (migration 0051_deadlines_at_the_commit) ====
-- commit_decision (in the version 5 section) queues the next step instead of going on in place once the
-- instance's deadline has passed and its timer is still open, so that the timer is taken; and gives back
-- the claim of a decision on '$saga' that finds its instance ended (a deadline decided before the end).

-- ==== version 52 (migration 0052_failed_children_stay_failed) ====
-- A join that closes a branch leaves the children that already ended as they are; why: the migration's header.
-- close_branches changes here; its one definition is in the version 2 section.

-- ==== version 53 (migration 0053_reassign_to_the_assignee) ====
-- A reassign or delegate to the user who holds the task already is 'unchanged' and records nothing;
-- why: the migration's header.
-- task_assign changes here; its one definition is in the version 7 section.

-- ==== version 54 (migration 0054_outbox_and_message_fixes) ====
-- The relay's claim (outbox.sql, `outbox_claim`, calls it) walks the pending events in id order on any
-- statistics; why: the migration's header.
CREATE FUNCTION {{schema}}.outbox_claim(p_limit integer, p_lease_seconds double precision, p_relay text,
                                        p_token uuid)
RETURNS TABLE (id bigint, event_id uuid, instance_id uuid, type text, key text, payload jsonb,
               trace_context jsonb, created_at timestamptz, attempts integer)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_window integer := 4 * p_limit + 100;
    v_horizon xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_now timestamptz := {{schema}}.db_now();
    v_seen integer;
    v_ids bigint[];
BEGIN
    -- Candidates, unlocked. First the oldest v_window unpublished events: the first of a key among
    -- them is its oldest, so a key is held back from its first event that is not claimable (dead,
    -- leased, backing off, above the horizon: outbox.sql's outbox_state is not 'pending') on.
    WITH win AS (
        SELECT o.id, o.key,
               {{schema}}.outbox_claimable(o.dead_at, o.xid, o.next_attempt_at, o.claimed_until, v_horizon, v_now)
                   AS ok
        FROM {{schema}}.outbox o
        WHERE o.published_at IS NULL
        ORDER BY o.id
        LIMIT v_window
    ), held AS (
        SELECT w.key, min(w.id) AS since FROM win w WHERE NOT w.ok AND w.key IS NOT NULL GROUP BY w.key
    )
    SELECT (SELECT count(*) FROM win),
           ARRAY(SELECT w.id FROM win w LEFT JOIN held h ON h.key = w.key
                 WHERE w.ok AND (h.since IS NULL OR w.id < h.since) ORDER BY w.id LIMIT p_limit)
    INTO v_seen, v_ids;
    -- Those held back filled the window (a key held back with a backlog behind it, say): rather than
    -- walk the backlog, take each key's oldest event by a skip over outbox_pending_key (one probe a
    -- key with unpublished events), the keys whose oldest is claimable in id order, and each one's
    -- claimable run from there; and the unkeyed events from outbox_pending_unkeyed.
    IF v_seen = v_window AND cardinality(v_ids) < p_limit THEN
        WITH RECURSIVE heads AS (
            (SELECT o.key, o.id, o.dead_at, o.xid, o.next_attempt_at, o.claimed_until FROM {{schema}}.outbox o
             WHERE o.published_at IS NULL AND o.key IS NOT NULL ORDER BY o.key, o.id LIMIT 1)
            UNION ALL
            SELECT n.* FROM heads h, LATERAL (
                SELECT o.key, o.id, o.dead_at, o.xid, o.next_attempt_at, o.claimed_until FROM {{schema}}.outbox o
                WHERE o.published_at IS NULL AND o.key IS NOT NULL AND o.key > h.key
                ORDER BY o.key, o.id LIMIT 1) n
        ), first_keys AS (
            SELECT h.key, h.id FROM heads h
            WHERE {{schema}}.outbox_claimable(h.dead_at, h.xid, h.next_attempt_at, h.claimed_until, v_horizon, v_now)
            ORDER BY h.id
            LIMIT p_limit
        ), runs AS (
            SELECT r.id FROM first_keys f, LATERAL (
                SELECT x.id, bool_and(x.ok) OVER (ORDER BY x.id) AS clear
                FROM (SELECT o.id,
                             {{schema}}.outbox_claimable(o.dead_at, o.xid, o.next_attempt_at, o.claimed_until,
                                                         v_horizon, v_now) AS ok
                      FROM {{schema}}.outbox o
                      WHERE o.key = f.key AND o.published_at IS NULL
                      ORDER BY o.id LIMIT p_limit) x) r
            WHERE r.clear
            UNION ALL
            SELECT u.id FROM (
                SELECT o.id FROM {{schema}}.outbox o
                WHERE o.published_at IS NULL AND o.key IS NULL
                  AND {{schema}}.outbox_claimable(o.dead_at, o.xid, o.next_attempt_at, o.claimed_until,
                                                  v_horizon, v_now)
                ORDER BY o.id LIMIT p_limit) u
        )
        SELECT ARRAY(SELECT r.id FROM runs r ORDER BY r.id LIMIT p_limit) INTO v_ids;
    END IF;
    -- Lock the candidates still claimable, skipping those another claim holds; then a candidate is
    -- dropped when its key has an older unpublished event this claim did not take (whatever chose the
    -- candidates, this keeps each key's order). Null keys ask for no order.
    RETURN QUERY
    WITH cand AS (
        SELECT c.id, c.key
        FROM {{schema}}.outbox c
        WHERE c.id = ANY (v_ids)
          AND c.published_at IS NULL
          AND {{schema}}.outbox_claimable(c.dead_at, c.xid, c.next_attempt_at, c.claimed_until, v_horizon, v_now)
        FOR UPDATE SKIP LOCKED
    ), keep AS (
        SELECT c.id FROM cand c
        WHERE c.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {{schema}}.outbox e
            WHERE e.key = c.key AND e.id < c.id AND e.published_at IS NULL
              AND e.id NOT IN (SELECT x.id FROM cand x))
    ), leased AS (
        UPDATE {{schema}}.outbox o SET
            claim_token = p_token,
            claimed_until = {{schema}}.db_now() + make_interval(secs => p_lease_seconds),
            claimed_by = p_relay
        FROM keep
        WHERE o.id = keep.id
        RETURNING o.id, o.event_id, o.instance_id, o.type, o.key, o.payload, o.trace_context,
                  o.created_at, o.attempts
    )
    SELECT * FROM leased ORDER BY leased.id;
END $$;

-- A repeated start-or-signal answers started = true when its first attempt started the instance:
-- the signal's dedup row says so (start_or_signal_with, in the version 21 section); why: the
-- migration's header.
ALTER TABLE {{schema}}.dedup ADD COLUMN started_instance boolean;

-- ==== version 55 (migration 0055_retries_and_deadlines) ====
-- An operator's retry bounds each retried step by its deadline again, and fires an instance deadline that
-- passed while the instance was FAILED; why: the migration's header.
-- retry_instance changes here; its one definition is in the version 1 section.

-- ==== version 56 (migration 0056_step_deadline_passed_when_it_applies) ====
-- interrupt_steps (in the version 6 section) records STEP_DEADLINE_PASSED itself, only for a step visit it
-- interrupts; why: the migration's header.

-- ==== version 57 (migration 0057_step_deadlines_at_the_commit) ====
-- commit_decision (in the version 5 section) refuses a step's commit that comes after the step's deadline
-- while the deadline's timer has not fired, and interrupts the step there as the timer would; why: the
-- migration's header.

-- ==== version 58 (migration 0058_crashes_count_alone) ====
-- A worker marks a suspect's claim that runs alone (queries.sql, `run_alone`), and crashes count only by
-- such claims; why: the migration's header.
ALTER TABLE {{schema}}.commands ADD COLUMN alone_claims integer;  -- NULL: none (why: the migration)
ALTER TABLE {{schema}}.commands ADD COLUMN alone_token uuid;

-- ==== version 59 (migration 0059_outbox_claim_skips_held_keys) ====
-- The relay's claim skips a key held back with a backlog instead of walking it; why: the migration's header.
-- outbox_claim changes here; its one definition is in the version 54 section.
-- Whether the unpublished event of these columns is claimable below the horizon p_horizon at p_now (not
-- dead, leased, backing off or above the horizon: outbox.sql's outbox_state is 'pending'). Inlined.
CREATE FUNCTION {{schema}}.outbox_claimable(p_dead_at timestamptz, p_xid xid8, p_next_attempt_at timestamptz,
                                            p_claimed_until timestamptz, p_horizon xid8, p_now timestamptz)
RETURNS boolean LANGUAGE sql IMMUTABLE
AS $$
    SELECT p_dead_at IS NULL AND (p_xid IS NULL OR p_xid < p_horizon)
       AND (p_next_attempt_at IS NULL OR p_next_attempt_at <= p_now)
       AND (p_claimed_until IS NULL OR p_claimed_until <= p_now)
$$;

-- ==== version 60 (migration 0060_outbox_and_business_key_indexes) ====
-- The unkeyed unpublished events in id order: the claim's skip past held keys takes them from here.
CREATE INDEX outbox_pending_unkeyed ON {{schema}}.outbox (id) WHERE published_at IS NULL AND key IS NULL;
-- A business key without a workflow finds its instances through an index of its own; why: the migration's
-- header.
CREATE INDEX instances_business_key_alone ON {{schema}}.instances (business_key) WHERE business_key IS NOT NULL;

-- ==== version 61 (migration 0061_deadlines_at_ending_and_leaving_commits) ====
-- commit_decision (in the version 5 section) does not end an instance past its deadline while the deadline's
-- timer has not fired: the deadline wins there, as its timer would; and it holds a wait's or timer's step
-- deadline at the commit of the signal, message or timer that leaves it, as at a handler's; why: the
-- migration's header.

-- ==== version 62 (migration 0062_replay_settles_child_saga_links) ====
-- A replay settles the saga link of a child stopped at COMPENSATION_FAILED, and a retry of that child is
-- refused; why: the migration's header.
-- replay_instance changes here; its one definition is in the version 9 section.
-- retry_saga changes here; its one definition is in the version 6 section.
-- compensate_child changes here; its one definition is in the version 6 section.

-- ==== version 63 (migration 0063_retried_child_step_keeps_its_child) ====
-- A child step run again at the visit that started its child does not insert it again, so its pin admission
-- does not refuse a version deprecated since; why: the migration's header.
-- start_children changes here; its one definition is in the version 2 section.

-- ==== version 64 (migration 0064_listings_on_their_custom_plans) ====
-- The operators' instance lists and counts run on their custom plans (the named queries call these); why:
-- the migration's header.
-- The operations' instance list and counts (operations.sql, find_instances and count_instances:
-- `stepstone list`, the repair's pages); every filter optional, archived instances only when p_archived.
CREATE FUNCTION {{schema}}.find_instances(
    p_statuses text[], p_definition text, p_version integer, p_scope text, p_key text, p_key_like text,
    p_parent uuid, p_created_since timestamptz, p_created_until timestamptz, p_updated_since timestamptz,
    p_updated_until timestamptz, p_archived boolean, p_before timestamptz, p_before_id uuid, p_limit bigint)
RETURNS TABLE (id uuid, scope text, definition_id text, version integer, status text, step text,
               business_key text, parent_id uuid, created_at timestamptz, updated_at timestamptz,
               ended_at timestamptz, archived_at timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT i.id, i.scope, i.definition_id, i.version, i.status, i.step, i.business_key, i.parent_id,
           i.created_at, i.updated_at, i.ended_at,
           CASE WHEN {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at) THEN i.archived_at END
    FROM {{schema}}.instances i
    WHERE (p_statuses IS NULL OR i.status = ANY (p_statuses))
      AND (p_definition IS NULL OR i.definition_id = p_definition)
      AND (p_version IS NULL OR i.version = p_version)
      AND (p_scope IS NULL OR i.scope = p_scope)
      AND (p_key IS NULL OR i.business_key = p_key)
      AND (p_key_like IS NULL OR i.business_key ILIKE p_key_like)
      AND (p_parent IS NULL OR i.parent_id = p_parent)
      AND (p_created_since IS NULL OR i.created_at >= p_created_since)
      AND (p_created_until IS NULL OR i.created_at < p_created_until)
      AND (p_updated_since IS NULL OR i.updated_at >= p_updated_since)
      AND (p_updated_until IS NULL OR i.updated_at < p_updated_until)
      AND (p_archived OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))
      AND (p_before IS NULL OR (i.created_at, i.id) < (p_before, p_before_id))
    ORDER BY i.created_at DESC, i.id DESC
    LIMIT p_limit;
END $$;

CREATE FUNCTION {{schema}}.count_instances(
    p_statuses text[], p_definition text, p_version integer, p_scope text, p_key text, p_key_like text,
    p_parent uuid, p_created_since timestamptz, p_created_until timestamptz, p_updated_since timestamptz,
    p_updated_until timestamptz, p_archived boolean)
RETURNS TABLE (status text, n bigint)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT i.status, count(*)
    FROM {{schema}}.instances i
    WHERE (p_statuses IS NULL OR i.status = ANY (p_statuses))
      AND (p_definition IS NULL OR i.definition_id = p_definition)
      AND (p_version IS NULL OR i.version = p_version)
      AND (p_scope IS NULL OR i.scope = p_scope)
      AND (p_key IS NULL OR i.business_key = p_key)
      AND (p_key_like IS NULL OR i.business_key ILIKE p_key_like)
      AND (p_parent IS NULL OR i.parent_id = p_parent)
      AND (p_created_since IS NULL OR i.created_at >= p_created_since)
      AND (p_created_until IS NULL OR i.created_at < p_created_until)
      AND (p_updated_since IS NULL OR i.updated_at >= p_updated_since)
      AND (p_updated_until IS NULL OR i.updated_at < p_updated_until)
      AND (p_archived OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))
    GROUP BY i.status ORDER BY i.status;
END $$;

-- The management API's instance list (management.sql, instances_page: the UI and GET /instances).
CREATE FUNCTION {{schema}}.instances_page(
    p_scopes text[], p_status text, p_definition text, p_key text, p_before timestamptz, p_before_id uuid,
    p_limit bigint, p_archived boolean)
RETURNS TABLE (id uuid, scope text, definition_id text, version integer, status text, step text,
               business_key text, parent_id uuid, created_at timestamptz, updated_at timestamptz,
               ended_at timestamptz, error jsonb, archived_at timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT i.id, i.scope, i.definition_id, i.version, i.status, i.step, i.business_key, i.parent_id,
           i.created_at, i.updated_at, i.ended_at, i.error,
           CASE WHEN {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at) THEN i.archived_at END
    FROM {{schema}}.instances i
    WHERE (p_archived OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))
      AND (p_scopes IS NULL OR i.scope = ANY (p_scopes))
      AND (p_status IS NULL OR i.status = p_status)
      AND (p_definition IS NULL OR i.definition_id = p_definition)
      AND (p_key IS NULL OR i.business_key = p_key)
      AND (p_before IS NULL OR (i.created_at, i.id) < (p_before, p_before_id))
    ORDER BY i.created_at DESC, i.id DESC
    LIMIT p_limit;
END $$;

-- How many instances of the status p_status the management API counts (management.sql, instance_count:
-- one call a status), at most p_cap + 1.
CREATE FUNCTION {{schema}}.instance_count(
    p_status text, p_scopes text[], p_definition text, p_cap bigint, p_archived boolean, p_key text)
RETURNS bigint
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    v_n bigint;
BEGIN
    SELECT count(*) INTO v_n FROM (
        SELECT 1 FROM {{schema}}.instances i
        WHERE i.status = p_status
          AND (p_scopes IS NULL OR i.scope = ANY (p_scopes)) AND (p_definition IS NULL OR i.definition_id = p_definition)
          AND (p_key IS NULL OR i.business_key = p_key)
          AND (p_archived OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))
        LIMIT p_cap + 1) c;
    RETURN v_n;
END $$;

-- The client's instance list (queries.sql, list_instances: Client.list).
CREATE FUNCTION {{schema}}.list_instances(
    p_status text, p_definition text, p_key text, p_before timestamptz, p_before_id uuid, p_limit bigint,
    p_scope text, p_archived boolean)
RETURNS TABLE (id uuid, definition_id text, version integer, status text, step text, business_key text,
               created_at timestamptz, updated_at timestamptz, scope text)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT i.id, i.definition_id, i.version, i.status, i.step, i.business_key, i.created_at, i.updated_at,
           i.scope
    FROM {{schema}}.instances i
    WHERE (p_archived OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))
      AND (p_status IS NULL OR i.status = p_status)
      AND (p_definition IS NULL OR i.definition_id = p_definition)
      AND (p_key IS NULL OR i.business_key = p_key)
      AND (p_before IS NULL OR (i.created_at, i.id) < (p_before, p_before_id))
      AND (p_scope IS NULL OR i.scope = p_scope)
    ORDER BY i.created_at DESC, i.id DESC
    LIMIT p_limit;
END $$;

-- ==== version 65 (migration 0065_deadline_timers_of_dead_workers) ====
-- A commit the deadline holds takes over a deadline's timer whose worker's lease has expired, and fires the
-- deadline there, as for a due free timer (fire_deadline_timer, called by commit_decision in the version 5
-- section); why: the migration's header.
-- The deadline's timer p_timer (on '$saga') fired by the commit of instance p_instance the deadline holds
-- (commit_decision, migrations 0057 and 0061): settled as fired (COMPLETE, by p_worker), true; false, and
-- nothing written, while a live worker holds it. Due and free (no claim, or a claim taking it now: its
-- worker fires it), or held by a worker whose lease has expired (it died, or lost its lease, and no claim
-- has taken it over yet): then the saga position's lease is taken from that worker as a claim would take
-- it (the position first, as the claim locks it), so that its late commit of the timer is fenced.
-- The caller holds the instance row (every commit of the instance waits for it) and its own position; the
-- rows here are skipped when locked, never waited for.
CREATE FUNCTION {{schema}}.fire_deadline_timer(p_instance uuid, p_timer bigint, p_now timestamptz,
                                               p_worker text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_token uuid;
BEGIN
    -- (IS TRUE: by the primary key, never a scan of a partial index, migration 0028.)
    PERFORM 1 FROM {{schema}}.commands x WHERE x.id = p_timer AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        -- An expired lease, as the claim's takeover reads it: the command's and the position's.
        SELECT x.token INTO v_token FROM {{schema}}.commands x
        WHERE x.id = p_timer AND (x.state = 'CLAIMED') IS TRUE AND x.available_at <= p_now;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        PERFORM 1 FROM {{schema}}.positions p
        WHERE p.instance_id = p_instance AND p.path = '$saga' AND p.lease_token = v_token
          AND (p.lease_until IS NULL OR p.lease_until <= p_now)
        FOR UPDATE SKIP LOCKED;  -- a claim taking the expired lease over now: its worker fires it
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        PERFORM 1 FROM {{schema}}.commands x
        WHERE x.id = p_timer AND x.token = v_token AND (x.state = 'CLAIMED') IS TRUE
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL,
            updated_at = p_now
        WHERE p.instance_id = p_instance AND p.path = '$saga' AND p.lease_token = v_token;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'COMPLETE', token = NULL, settled_at = p_now, claimed_by = p_worker
    WHERE c.id = p_timer;
    RETURN true;
END $$;

-- ==== version 66 (migration 0066_operator_reads_on_their_custom_plans) ====
-- The external-task list and the stranded-pins report run on their custom plans (the named queries call
-- these); why: the migration's header.
-- The external-task list (external.sql, external_list): oldest first, of topic p_topic, status p_status,
-- instance p_instance (each any when NULL), after the row (p_after_at, p_after_id) when a cursor gave one.
CREATE FUNCTION {{schema}}.external_list(
    p_topic text, p_status text, p_instance uuid, p_limit bigint, p_after_at timestamptz, p_after_id uuid)
RETURNS TABLE (id uuid, instance_id uuid, "position" text, step text, visit integer, topic text, status text,
               retries integer, attempts integer, available_at timestamptz, lock_owner text,
               lock_until timestamptz, last_error text, command_id bigint, created_at timestamptz,
               ended_at timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT t.id, t.instance_id, t.position, t.step, t.visit, t.topic, t.status, t.retries, t.attempts,
           t.available_at, t.lock_owner, t.lock_until, t.last_error, t.command_id, t.created_at, t.ended_at
    FROM {{schema}}.external_tasks t
    WHERE (p_topic IS NULL OR t.topic = p_topic) AND (p_status IS NULL OR t.status = p_status)
      AND (p_instance IS NULL OR t.instance_id = p_instance)
      AND (p_after_at IS NULL OR (t.created_at, t.id) > (p_after_at, p_after_id))
    ORDER BY t.created_at, t.id
    LIMIT p_limit;
END $$;

-- The stranded-pins report (registry.sql, stranded): live instances (those that move by themselves: a
-- COMPENSATING saga too, FAILED ones wait for an operator) whose pin no worker served within p_within
-- seconds, per pin; of the scopes p_scopes alone when given.
CREATE FUNCTION {{schema}}.stranded(p_within double precision, p_scopes text[])
RETURNS TABLE (scope text, definition_id text, version integer, plan_hash text, instances bigint,
               deferred_commands bigint, last_served timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT i.definition_scope AS scope, i.definition_id, i.version, i.plan_hash, count(*) AS instances,
           (SELECT count(*) FROM {{schema}}.commands c JOIN {{schema}}.instances j ON j.id = c.instance_id
            WHERE c.state = 'DEFERRED' AND j.definition_id = i.definition_id AND j.version = i.version
              AND j.plan_hash = i.plan_hash AND j.definition_scope IS NOT DISTINCT FROM i.definition_scope
              AND (p_scopes IS NULL OR j.scope = ANY(p_scopes))) AS deferred_commands,
           (SELECT max(w.seen_at) FROM {{schema}}.worker_plans w
            WHERE w.definition_id = i.definition_id AND w.version = i.version AND w.plan_hash = i.plan_hash)
               AS last_served
    FROM {{schema}}.instances i
    WHERE i.status IN ('PENDING', 'RUNNING', 'WAITING', 'COMPENSATING')
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
                      WHERE w.definition_id = i.definition_id AND w.version = i.version
                        AND w.plan_hash = i.plan_hash
                        AND w.seen_at > {{schema}}.db_now() - make_interval(secs => p_within))
      AND (p_scopes IS NULL OR i.scope = ANY(p_scopes))
    GROUP BY i.definition_scope, i.definition_id, i.version, i.plan_hash
    ORDER BY i.definition_id, i.version;
END $$;

-- ==== version 67 (migration 0067_claims_in_queue_order) ====
-- claim_heads (in the version 36 section) returns its batch in the order the commands became claimable;
-- why: the migration's header.

-- ==== version 68 (migration 0068_message_ids_and_buffered_deliveries) ====
-- publish_message (in the version 7 section) takes a lock on its message id before the correlation key's, and
-- command_recorded (in the version 7 section) does not count a buffered message a wait takes against the
-- open-signal cap; why: the migration's header.

-- ==== version 69 (migration 0069_purges_and_baselines) ====
-- instances_deleted (in the version 49 section) deletes the instance's compensation records too,
-- retention_batch (in the version 22 section) counts a child that ended TIMED_OUT or COMPENSATED as ended,
-- history_redact_baseline (in the version 23 section) redacts a migration's baseline as a start's, and
-- stranded (in the version 66 section) reports COMPENSATING instances too; why: the migration's header.

-- ==== version 70 (migration 0070_deferrals_beside_a_live_worker) ====
-- defer_command (in the version 17 section) waits briefly while a worker that has the pin heartbeats;
-- why: the migration's header.

-- ==== version 71 (migration 0071_probe_listing_on_its_custom_plan) ====
-- The probe's listing of open commands runs on its custom plan (operations.sql, open_commands, calls it);
-- why: the migration's header.
-- The execution probe's listing of open commands (operations.sql, open_commands), of one instance
-- p_instance or all, of the instances the filters p_statuses..p_archived keep (operations.sql's
-- instance_filter, as find_instances states it), with probe_columns' flags; the first p_limit by instance.
CREATE FUNCTION {{schema}}.probe_listing(
    p_statuses text[], p_definition text, p_version integer, p_scope text, p_key text, p_key_like text,
    p_parent uuid, p_created_since timestamptz, p_created_until timestamptz, p_updated_since timestamptz,
    p_updated_until timestamptz, p_archived boolean, p_instance uuid, p_limit bigint)
RETURNS TABLE (id bigint, instance_id uuid, "position" text, kind text, state text, step text, attempt integer,
               available_at timestamptz, created_at timestamptz, last_error text, claimed_by text,
               in_flight boolean, claimable boolean)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT c.id, c.instance_id, c.position, c.kind, c.state, c.step, c.attempt, c.available_at, c.created_at,
           c.last_error, c.claimed_by,
           c.state = 'CLAIMED' AND p.lease_until > {{schema}}.db_now() AS in_flight,
           c.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND c.available_at <= {{schema}}.db_now()
           AND (p.lease_until IS NULL OR p.lease_until <= {{schema}}.db_now())
           AND NOT EXISTS (
               SELECT 1 FROM {{schema}}.commands e
               WHERE e.instance_id = c.instance_id AND e.position = c.position
                 AND e.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                 AND (e.seq, e.id) < (c.seq, c.id)
                 AND NOT (e.kind = 'TIMER' AND e.available_at > {{schema}}.db_now())
               OFFSET 0) AS claimable
    FROM {{schema}}.commands c
    JOIN {{schema}}.instances i ON i.id = c.instance_id
    LEFT JOIN {{schema}}.positions p ON p.instance_id = c.instance_id AND p.path = c.position
    WHERE (p_statuses IS NULL OR i.status = ANY (p_statuses))
      AND (p_definition IS NULL OR i.definition_id = p_definition)
      AND (p_version IS NULL OR i.version = p_version)
      AND (p_scope IS NULL OR i.scope = p_scope)
      AND (p_key IS NULL OR i.business_key = p_key)
      AND (p_key_like IS NULL OR i.business_key ILIKE p_key_like)
      AND (p_parent IS NULL OR i.parent_id = p_parent)
      AND (p_created_since IS NULL OR i.created_at >= p_created_since)
      AND (p_created_until IS NULL OR i.created_at < p_created_until)
      AND (p_updated_since IS NULL OR i.updated_at >= p_updated_since)
      AND (p_updated_until IS NULL OR i.updated_at < p_updated_until)
      AND (p_archived OR NOT {{schema}}.is_archived(i.archived_at, i.ended_at, i.updated_at))
      AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
      AND (p_instance IS NULL OR c.instance_id = p_instance)
    ORDER BY c.instance_id, c.seq, c.id
    LIMIT p_limit;
END $$;

-- ==== version 72 (migration 0072_queued_signals_wait_off_the_ready_walk) ====
-- command_recorded (in the version 7 section) gives a signal, message or task completion recorded behind
-- another one still open on its position an available_at a minute on; why: the migration's header.
-- When a signal, message or task completion leaves its position's queue (settled, parked, dead, rejected,
-- superseded), whichever statement closes it, one trigger:
-- * the first one waiting behind it off the ready walk becomes available now (one row; the requeue trigger
--   wakes the workers). Over-promotion is harmless: the claim still checks the head;
-- * a message a wait took from the buffer and never applied goes on to the next wait of its name and key
--   (return_buffered_message, version 74).
CREATE FUNCTION {{schema}}.command_left_queue() RETURNS trigger
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

-- One trigger for both: a settle consults one more WHEN, not two (tests/perf/test_trigger_conditions.py).
CREATE TRIGGER commands_left_queue
    AFTER UPDATE OF state ON {{schema}}.commands
    FOR EACH ROW WHEN (OLD.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION')
                       AND OLD.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                       AND NEW.state NOT IN ('PENDING', 'DEFERRED', 'CLAIMED'))
    EXECUTE FUNCTION {{schema}}.command_left_queue();

-- ==== version 73 (migration 0073_children_kept_under_a_live_parent) ====
-- retention_batch (in the version 22 section) keeps an instance whose parent has not ended; why: the
-- migration's header.

-- ==== version 74 (migration 0074_buffered_messages_go_on) ====
-- A buffered message taken by a wait that something else then left goes on to the next wait of its name
-- and key; why: the migration's header. open_subscriptions (in the version 7 section) and publish_message
-- deliver through deliver_to_subscription (below) too.
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

-- ==== version 75 (migration 0075_publish_waits_for_busy_instances) ====
-- publish_message (in the version 7 section) takes the rows of the instances it delivers to before the
-- correlation key's lock, waiting for a busy one, and it and return_buffered_message (in the version 74
-- section) ask subscription_takes whether a subscription's wait is still open; why: the migration's header.
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

-- ==== version 76 (migration 0076_deferred_commands_routed_by_pin) ====
-- defer_command (in the version 17 section) moves a command deferred for want of its plan to the route of
-- its instance's pin, migrate_instance (in the version 8 section) moves an instance's routed commands back,
-- and claim_heads (in the version 36 section) serves an earlier release's worker the routes of its
-- definitions; why: the migration's header.
-- The key a command is queued under (commands.definition) once a worker that lacked its plan deferred it:
-- the pin's definition id, version and plan hash. A definition id is a name (no '@'), so a route is never
-- one; a worker names the routes of the pins it has among the keys it serves (Pin.route).
CREATE FUNCTION {{schema}}.command_route(p_definition text, p_version integer, p_plan_hash text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_definition || '@' || p_version::text || '@' || p_plan_hash $$;

-- A served list of definition ids alone (a worker of a release before version 76) with the routes of those
-- definitions: each recorded version's, and each one that has ready work (ready_routes, version 85). Such a
-- worker claims routed commands as it claimed every command of its definitions before, and defers those it
-- lacks again.
CREATE FUNCTION {{schema}}.served_with_routes(p_served text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_served IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN p_served || ARRAY(
        SELECT {{schema}}.command_route(d.definition_id, d.version, d.plan_hash)
        FROM {{schema}}.definitions d WHERE d.definition_id = ANY (p_served)
        UNION
        SELECT r.k FROM unnest({{schema}}.ready_routes(p_served)) AS r(k));
END $$;

-- ==== version 77 (migration 0077_returned_messages_reach_busy_waits) ====
-- return_buffered_message (in the version 74 section) gives a message to the oldest open wait of its name and
-- key even when that wait's instance is busy, without its row, and command_recorded (in the version 7 section)
-- records such a command (`instance_busy`) without moving or waiting for anything; why: the migration's header.
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

-- commit_decisions (in the version 2 section) hands on the buffered messages its items settle untaken after
-- every item, in key order, and command_left_queue (in the version 72 section) leaves them to it; why: the
-- migration's header.
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

-- ==== version 78 (migration 0078_ttl_under_a_microsecond_refused) ====
-- publish_message (in the version 7 section) refuses a ttl under a microsecond (SQLSTATE SSM01), and
-- publish_in_caller_transaction (in the version 18 section) answers it `invalid`, the caller's transaction
-- still usable; why: the migration's header.

-- ==== version 79 (migration 0079_ttl_bounds_and_one_key_order) ====
-- publish_message (in the version 7 section) refuses a negative, NaN, infinite or longer than a thousand years
-- ttl (SQLSTATE SSM01, as a ttl under a microsecond), and publish_in_caller_transaction answers it `invalid`;
-- open_subscriptions (in the version 7 section) takes the keys of the messages its commit hands on with its
-- own, in one order; why: the migration's header.

-- ==== version 80 (migration 0080_schema_reads_by_the_instances_plan) ====
-- retry_instance (in the version 1 section) reads the step deadlines of the instance's own plan (its plan
-- hash) in its definition scope's registration; send_signal (version 1 section) and signal_position (version
-- 2 section) accept a signal that plan declares; start_children (version 2 section) redacts an existing
-- child's report by pinned_sensitive_paths; why: the migration's header.
-- The sensitive paths of the plan an instance runs: its plan's (the row of its plan hash in its definition
-- scope, or in its own scope where it was registered after the instance started) when that is stored;
-- otherwise every path a stored plan of its workflow marks, any version, in its definition scope or its own
-- (the version's row among them), as the views redact (management.sql).
-- Every path any stored plan of a workflow marks under `p_key` ('sensitive' or 'sensitive_payloads'), in the
-- two scopes given: what an instance whose own plan is not stored is redacted by, since its own paths are
-- unknown (never less than the version's row). The one place of that rule: pinned_sensitive_paths and the
-- operators' reads (management.sql's instance_redactions, operations.sql's instance_extra) use it.
CREATE FUNCTION {{schema}}.stored_sensitive_paths(p_scope text, p_definition_scope text, p_definition_id text,
                                                  p_key text)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_agg(DISTINCT p) FROM {{schema}}.definitions d
    CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(d.plan -> p_key) = 'array'
                                                 THEN d.plan -> p_key END) p
    WHERE d.scope IN (p_definition_scope, p_scope) AND d.definition_id = p_definition_id
$$;

CREATE FUNCTION {{schema}}.pinned_sensitive_paths(p_scope text, p_definition_scope text, p_definition_id text,
                                                  p_version integer, p_plan_hash text)
RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_plan jsonb;
BEGIN
    SELECT o.plan INTO v_plan FROM {{schema}}.definitions o
    WHERE o.scope IN (p_definition_scope, p_scope) AND o.definition_id = p_definition_id
      AND o.version = p_version AND o.plan_hash = p_plan_hash
    ORDER BY o.scope = p_definition_scope DESC LIMIT 1;
    IF FOUND THEN
        RETURN v_plan -> 'sensitive';
    END IF;
    RETURN {{schema}}.stored_sensitive_paths(p_scope, p_definition_scope, p_definition_id, 'sensitive');
END $$;

-- ==== version 81 (migration 0081_definitions_listing_on_its_custom_plan) ====
-- list_definitions: the definitions listing (registry.sql) on its custom plan; why: the migration's header.
-- The definitions listing (registry.sql, list_definitions): versions of scope p_scope, workflow
-- p_definition, status p_status (each any when NULL), metadata only, with whether an activation names it.
CREATE FUNCTION {{schema}}.list_definitions(p_scope text, p_definition text, p_status text)
RETURNS TABLE (scope text, definition_id text, version integer, kind text, status text, plan_hash text,
               state_model text, signal_names jsonb, document_format text, document_digest text,
               registered_at timestamptz, status_changed_at timestamptz, active boolean)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT d.scope, d.definition_id, d.version, d.kind, d.status, d.plan_hash, d.state_model, d.signal_names,
           d.document_format, d.document_digest, d.registered_at, d.status_changed_at,
           EXISTS (SELECT 1 FROM {{schema}}.definition_activations a
                   WHERE a.target_scope = d.scope AND a.definition_id = d.definition_id AND a.version = d.version)
    FROM {{schema}}.definitions d
    WHERE (p_scope IS NULL OR d.scope = p_scope) AND (p_definition IS NULL OR d.definition_id = p_definition)
      AND (p_status IS NULL OR d.status = p_status)
    ORDER BY d.definition_id, d.scope, d.version;
END $$;

-- ==== version 82 (migration 0082_dead_messages_offered_again) ====
-- retry_instance (in the version 1 section) offers a dead-lettered message again, to the wait it was delivered
-- to, which waits again without a RETRY; why: the migration's header.

-- ==== version 83 (migration 0083_child_retry_refused_once_its_parent_moved_on) ====
-- retry_instance (version 1 section) refuses a child whose parent no longer awaits it (outcome
-- not_awaited), and replay_instance (version 9 section) locks the children before it writes and refuses
-- while a child it awaits is under way (outcome child_live); why: the migration's header.
-- Where a child stands with its parent: 'awaited' while the parent's position that started it is still at
-- that step visit and waits or runs there, in a parent that has not ended or begun to compensate, or failed
-- there in a parent that failed (retried, it goes on with the child's result; a branch that failed in a
-- parent that goes on without it, its join not needing it, is not awaited: version 90); 'abandoned' when the parent ended, or compensates or
-- stopped compensating (version 90), with that position cancelled at that visit and the child was started
-- with cancel_with_parent false (it runs on as an instance of its own: neither the parent's cancel nor its
-- compensation touches it); else 'not_awaited' (the parent moved on: replayed, took on_failure, ended,
-- compensates, closed the child's branch, or no longer exists).
CREATE FUNCTION {{schema}}.child_standing(p_child {{schema}}.instances)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p.status IN ('PENDING', 'RUNNING', 'WAITING', 'FAILED')
             AND (x.status IN ('RUNNING', 'WAITING') OR x.status = 'FAILED' AND p.status = 'FAILED')
        THEN 'awaited'
        WHEN NOT p_child.cancel_with_parent AND x.status = 'CANCELLED'
             AND ({{schema}}.is_terminal(p.status) OR p.status IN ('COMPENSATING', 'COMPENSATION_FAILED'))
        THEN 'abandoned'
        ELSE 'not_awaited' END
    FROM (SELECT 1) AS one
    LEFT JOIN {{schema}}.instances p ON p.id = p_child.parent_id
    LEFT JOIN {{schema}}.positions x ON x.instance_id = p.id AND x.path = COALESCE(p_child.parent_position, '')
                                    AND x.visit = p_child.parent_visit
$$;

-- What a refused retry of a child says of its parent: the parent's status, the position that started the
-- child as it is now (status, step, visit), the visit that started the child, the child the position
-- awaits (or started) at its current visit, and the child's own step (the one a replay of it would name).
CREATE FUNCTION {{schema}}.parent_of_child(p_child uuid)
RETURNS TABLE (parent_id uuid, parent_status text, parent_position text, position_status text,
               position_step text, position_visit integer, child_visit integer, awaits uuid, child_step text)
LANGUAGE sql STABLE AS $$
    SELECT c.parent_id, p.status, COALESCE(c.parent_position, ''), x.status, x.step, x.visit, c.parent_visit,
           CASE WHEN x.wait->>'kind' = 'child' THEN (x.wait->>'child_id')::uuid
                ELSE (SELECT k.id FROM {{schema}}.instances k
                      WHERE k.parent_id = c.parent_id AND COALESCE(k.parent_position, '') = x.path
                        AND k.parent_visit = x.visit AND k.id <> c.id
                      ORDER BY k.id LIMIT 1) END,
           c.step
    FROM {{schema}}.instances c
    LEFT JOIN {{schema}}.instances p ON p.id = c.parent_id
    LEFT JOIN {{schema}}.positions x ON x.instance_id = p.id AND x.path = COALESCE(c.parent_position, '')
    WHERE c.id = p_child
$$;

-- ==== version 84 (migration 0084_commands_routed_index) ====
-- The routed ready commands (PENDING or DEFERRED under a route, command_route), read by the claim and
-- ready_routes alone (version 85).
CREATE INDEX commands_routed ON {{schema}}.commands (definition)
    WHERE (state IN ('PENDING', 'DEFERRED')) IS TRUE AND strpos(definition, '@') > 0;

-- ==== version 85 (migration 0085_routes_walked_when_they_hold_work) ====
-- claim_heads (in the version 36 section) walks of the served routes those that hold ready work alone, and
-- served_with_routes (in the version 76 section) finds a definition's routes with ready_routes; why: the
-- migration's header.

-- The routes (command_route) that hold PENDING or DEFERRED commands, of the definitions p_definitions (every
-- one's when NULL), in order: one probe of commands_routed a route and one more, as ready_definitions()
-- walks commands_ready.
CREATE FUNCTION {{schema}}.ready_routes(p_definitions text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        WITH RECURSIVE r AS (
            (SELECT c.definition FROM {{schema}}.commands c
             WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND strpos(c.definition, '@') > 0
             ORDER BY c.definition LIMIT 1)
            UNION ALL
            SELECT (SELECT c.definition FROM {{schema}}.commands c
                    WHERE (c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND strpos(c.definition, '@') > 0
                      AND c.definition > r.definition
                    ORDER BY c.definition LIMIT 1)
            FROM r WHERE r.definition IS NOT NULL
        )
        SELECT COALESCE(array_agg(r.definition), '{}') FROM r
        WHERE r.definition IS NOT NULL
          AND (p_definitions IS NULL OR split_part(r.definition, '@', 1) = ANY (p_definitions)));
END $$;

-- ==== version 86 (migration 0086_dead_results_offered_again) ====
-- retry_instance (in the version 1 section) offers a dead-lettered branch's report and external task's
-- completion again, to the join or external step that waits again without a RETRY, with the reports parked at
-- that join while it was failed, and gives a human task whose completion was dead-lettered back, its step
-- waiting again without a RETRY (a dead timer of a task step likewise: offered again); why: the migration's
-- header.

-- ==== version 87 (migration 0087_published_messages_go_on) ====
-- publish_message (in the version 7 section) marks the command of a message delivered to one wait `goes_on`
-- and records its row on the subscription; command_left_queue (in the version 72 section) hands such a message
-- on when its wait is left before it, and return_buffered_message (in the version 74 section) gives one with
-- no ttl to an open wait of its key, else drops it; why: the migration's header.

-- ==== version 88 (migration 0088_task_key_after_hand_back) ====
-- task_key_seen and task_complete (in the version 7 section): a completion's key whose completion was handed
-- back is no duplicate; the same request reserves the task again under it; why: the migration's header.

-- ==== version 89 (migration 0089_child_retry_waits_for_its_report) ====
-- retry_instance (in the version 1 section) refuses a child whose failure report its parent, still awaiting
-- it, has not applied yet (outcome report_pending); why: the migration's header.

-- ==== version 90 (migration 0090_children_and_their_parents_sagas) ====
-- child_standing (in the version 83 section): a detached child whose parent compensates, or stopped
-- compensating, with its child step cancelled is abandoned, as once the parent has ended, and a child of a
-- branch that failed in a parent that goes on without it is not awaited; saga_begin (in the
-- version 6 section) records the children it takes over first, and record_open_children (in the version 16
-- section) records a completed child whose report waits unapplied too, so the saga compensates it; why: the
-- migration's header.

-- ==== version 91 (migration 0091_one_deadline_timer_a_visit) ====
-- schedule_step_deadlines (in the version 6 section) queues no step deadline timer for a step visit that has
-- one open; why: the migration's header.

-- ==== version 92 (migration 0092_join_losers_children_compensated) ====
-- close_branches (in the version 2 section) records a child that completed in a branch its join closes, whose
-- report the branch had not applied, as the report would have, so a later saga compensates it with the
-- branch's steps; record_open_children (in the version 16 section) reads such children through
-- reported_children too; why: the migration's header.
-- A child step's COMPLETED child whose report its position, still waiting for it, has not applied (queued, or
-- claimed by a worker applying it), in a plan that declares a compensation and for a child that goes with its
-- parent: what that report would record (core/saga.py, on_child_completed), under a path prefix ('' for all);
-- with p_closed, of the positions at those paths that were closed waiting for it (its report not applied).
CREATE FUNCTION {{schema}}.reported_children(p_instance uuid, p_prefix text, p_closed text[])
RETURNS TABLE (child_id uuid, path text, step text, visit integer)
LANGUAGE sql STABLE AS $$
    SELECT c.id, x.path, x.step, x.visit
    FROM {{schema}}.positions x
    JOIN {{schema}}.instances c ON c.id = (x.wait->>'child_id')::uuid
    WHERE x.instance_id = p_instance AND left(x.path, length(p_prefix)) = p_prefix
      AND (x.status = 'WAITING' AND p_closed IS NULL OR x.status = 'CANCELLED' AND x.path = ANY (p_closed))
      AND x.wait->>'kind' = 'child'
      AND c.parent_id = p_instance AND c.status = 'COMPLETED' AND c.cancel_with_parent
      AND COALESCE(c.parent_position, '') = x.path AND c.parent_visit = x.visit
      AND EXISTS (SELECT 1 FROM {{schema}}.commands r
                  WHERE r.instance_id = p_instance AND r.position = x.path AND r.kind = 'CHILD_COMPLETION'
                    AND (CASE WHEN p_closed IS NULL THEN r.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                              ELSE r.state <> 'COMPLETE' END) IS TRUE
                    AND r.visit = x.visit AND r.payload->>'child_id' = c.id::text
                    AND r.payload->>'status' = 'COMPLETED')
      AND EXISTS (SELECT 1 FROM {{schema}}.instances i
                  JOIN {{schema}}.definitions d ON d.scope IN (i.definition_scope, i.scope)
                       AND d.definition_id = i.definition_id AND d.version = i.version
                       AND d.plan_hash = i.plan_hash
                  CROSS JOIN LATERAL jsonb_array_elements(d.plan->'steps') AS s
                  WHERE i.id = p_instance AND s ? 'compensation')
$$;
