-- Waiting instances store what they wait for, and the pin they started on, once.
--
-- The instance row kept a copy of its root position's `wait` (the commit wrote it whenever the root
-- moved), and every INSTANCE_STARTED history entry carried the instance's version and plan hash beside
-- its baseline state. Both were stored twice: the position holds the wait that claims read,
-- and the pin an instance started on is its row's until a migration moves it, whose INSTANCE_MIGRATED
-- entry names the pin it came from (`from_version`, `from_plan_hash`). A waiting instance was about
-- 220 bytes larger on disk for them (docs/performance.md, "Stored once").
--
-- commit_decision and migrate_instance no longer write `instances.wait`, and start_instance,
-- start_children and start_batch write `{"state": ...}` (a child's also its parent) as the start
-- entry's data. The column stays (migrations are additive): rows written before keep their copy, which
-- nothing reads any more; `get_instance` reads the root position's wait. No worker ever read the copy
-- (claims and commits read the position's), so a worker of the previous release runs on unchanged
-- during a rolling deploy; that release's `stepstone show`, API and UI show no "waiting for" for an
-- instance that begins a wait after this migration, until they are replaced. The function bodies
-- below are the current ones with only those lines changed.

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
    v_follow jsonb := d->'next';
    v_commands jsonb := COALESCE(d->'commands', '[]'::jsonb);
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
    END IF;
    UPDATE {{schema}}.instances i SET
        status = COALESCE(v_status, i.status),
        state = CASE WHEN v_state IS NOT NULL THEN v_state WHEN v_has_state THEN d->'state' ELSE i.state END,
        state_version = i.state_version + CASE WHEN v_has_state THEN 1 ELSE 0 END,
        error = CASE WHEN v_pstatus = 'FAILED' THEN v_move->'error' ELSE i.error END,
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
    IF v_next IS NULL THEN
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
                     -- the queue index, by instance and position (migration 0028)
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
                     AND x.available_at <= v_now) THEN
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

CREATE OR REPLACE FUNCTION {{schema}}.migrate_instance(
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
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
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
    UPDATE {{schema}}.commands c SET step = p_step_map->>c.step
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                     AND x.step IS NOT NULL AND p_step_map ? x.step
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

CREATE OR REPLACE FUNCTION {{schema}}.start_instance(
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
        INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, dedup_key, available_at,
                                         created_at)
        SELECT p_id, 1, 'START', 'PENDING', p_step, 1, p_key, go.now, go.now FROM go
    ), hist AS (
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
        SELECT p_id, 1, go.now, 'INSTANCE_STARTED', p_step, 1, p_actor,
               jsonb_build_object('state', p_state) FROM go
    )
    SELECT inst.id FROM inst
    INTO v_id;
    RETURN v_id;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.start_children(p_instance uuid, p_position text, p_visit integer, p_children jsonb,
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
                    jsonb_build_object('state', c->'state', 'parent', p_instance, 'parent_position', p_position));
        END IF;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.start_batch(
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
        INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, dedup_key, available_at,
                                         created_at)
        SELECT go.id, 1, 'START', 'PENDING', p_step, 1, go.key, v_now, v_now FROM go
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
                          (extract(epoch FROM v_now) * 1000)::bigint::text);
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
