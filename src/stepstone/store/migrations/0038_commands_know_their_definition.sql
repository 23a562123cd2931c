-- Every command carries its instance's definition id, so that a worker serving some workflows can find
-- their work without reading another workflow's backlog.
--
-- The claim of a worker that serves some definitions walked the ready commands of every workflow in time
-- order and looked up each one's instance to keep its own: behind 20,000 queued starts of another
-- workflow a claim took 26-31 ms (tests/perf/claim_plans.py served), and more with every start queued.
-- The column is written where a command is made: the starts (start_instance, start_batch) and the step
-- commit (commit_decision, which reads the id with the instance's lock) name it, and a trigger fills it
-- for every other insert from the instance's row (WHEN: a command that names it never calls the
-- trigger). An insert for an instance that does not exist fails, as it must: such a command could never
-- run. Commands that may still run are given theirs here; settled ones keep NULL, which nothing reads.
-- The wake-up notifications name it too, after the due time ("<epoch ms>:<definition>"): a worker ignores
-- those of workflows it does not serve, where every pool of a fleet split by workflow woke for every
-- command of every other pool, for an empty claim (4 idle workers of another workflow made 593 claims a
-- second and took 28% of a busy worker's throughput: tests/perf/ab_throughput.py --idle 4). A worker of
-- the previous release cannot read the new payload and claims at once, as it did before due times.
-- Migration 0039 indexes the ready ones by definition and 0040 claims through that index. Measured in
-- docs/performance.md, "A worker that serves some workflows".
--
-- commit_decision also checks the version the segment ran (the commit document's `version`) against the
-- instance's, and gives the claim back when a migration moved the instance on since the claim read it:
-- a claim whose statement ran while a migration committed read the instance row of its snapshot, and
-- its worker ran the old version's step on the migrated instance (seen once under load in
-- tests/registry/test_migration_branches.py: an instance migrated to v2 whose last step ran v1's).
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

UPDATE {{schema}}.commands c SET definition = i.definition_id
FROM {{schema}}.instances i
WHERE i.id = c.instance_id AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD');

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
    v_definition text;
    v_pinned integer;
    v_branches integer;
    v_hist integer;
    v_pstatus text;
    v_status text;
    v_cur_seq bigint;
    v_next bigint;
    v_state jsonb;
    v_timer jsonb;
    v_timer_at integer;
    v_in_place bigint;
    x jsonb;
BEGIN
    -- 1. The instance row (first in the lock order), and the shared state's version.
    SELECT i.state_version, i.branches, i.history_seq, i.definition_id, i.version
    INTO v_version, v_branches, v_hist, v_definition, v_pinned
    FROM {{schema}}.instances i WHERE i.id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_pinned <> (d->>'version')::integer THEN  -- (a previous release sends no version: NULL, no test)
        -- A migration moved the instance to another version after this segment's claim read it: a claim
        -- whose statement ran while the migration committed locks the position as the migration left it
        -- but reads the instance row of its snapshot, pin included. What the segment decided followed a
        -- plan the instance no longer has, so nothing of it is written: the claim is given back, and the
        -- command runs again at once under the new plan (migration 0038; the worker counts it fenced).
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

CREATE OR REPLACE FUNCTION {{schema}}.notify_command() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('stepstone_' || TG_TABLE_SCHEMA,
                      (extract(epoch FROM NEW.available_at) * 1000)::bigint::text || COALESCE(':' || NEW.definition, ''));
    RETURN NULL;
END $$;
