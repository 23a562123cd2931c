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
CREATE INDEX instances_definition_newest ON {{schema}}.instances (definition_id, created_at DESC, id DESC);
-- (Newest first within a scope: instances_scope_newest, from migration 0008.)
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

-- One bounded batch of a retention sweep (phase 'archive' or 'purge'), in its own transaction.
-- Candidates come in id order after `p_after` (the caller's cursor, so a sweep visits each once),
-- their rows taken with FOR UPDATE SKIP LOCKED: a worker committing there right now makes the
-- instance busy, never a wait. A candidate is then left alone when a position is locked or leased
-- (busy), when it has a PENDING, DEFERRED or CLAIMED command or a child that has not ended (active),
-- and, for a purge, when it holds
-- an outbox event not published yet (unsent) or dead-lettered (dead): there is no age at which
-- dropping an unsent event is right. A dry run decides the same and writes nothing. A purge takes the
-- instance's positions, commands, dedup keys and history; its published events are left to their own
-- window (`outbox_published`), which the sweep applies after the instances.
-- Lock order: instance rows (ascending id, SKIP LOCKED) -> their positions (SKIP LOCKED) -> commands
-- -> history -> outbox; nothing here waits for a row a worker holds (lock_timeout is the net).
CREATE FUNCTION {{schema}}.retention_batch(p_phase text, p_limit integer, p_after uuid, p_dry_run boolean)
RETURNS TABLE (last_id uuid, scanned integer, done integer, busy integer, active integer, unsent integer,
               dead integer, done_ids uuid[])
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_min interval;
    v_cands uuid[];
    v_locked uuid[];
    v_free uuid[];
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
              AND (i.archived_at IS NULL OR i.archived_at < COALESCE(i.ended_at, i.updated_at))
              AND COALESCE(i.ended_at, i.updated_at) < v_now - v_min
              AND COALESCE(i.ended_at, i.updated_at) < v_now - w.retain_for
            ORDER BY i.id LIMIT p_limit) x;
    ELSE
        SELECT array_agg(x.id ORDER BY x.id) INTO v_cands FROM (
            SELECT i.id FROM {{schema}}.instances i
            CROSS JOIN LATERAL {{schema}}.retention_window(i.definition_id, {{schema}}.retention_class(i.status)) w
            WHERE (p_after IS NULL OR i.id > p_after) AND i.archived_at IS NOT NULL
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
    -- Active: a command still to run, or a child that has not ended (it reports to this instance).
    -- Then, for a purge, events a consumer has not had.
    SELECT array_agg(f.id ORDER BY f.id) INTO v_ok FROM unnest(v_free) AS f(id)
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.commands c
                      WHERE c.instance_id = f.id AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED'))
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.instances k
                      WHERE k.parent_id = f.id AND k.status NOT IN ('COMPLETED', 'CANCELLED'))
      AND (p_phase = 'archive' OR NOT EXISTS (SELECT 1 FROM {{schema}}.outbox o
                                              WHERE o.instance_id = f.id AND o.published_at IS NULL));
    v_ok := COALESCE(v_ok, '{}');
    last_id := v_cands[cardinality(v_cands)];
    scanned := cardinality(v_cands);
    done := cardinality(v_ok);
    busy := cardinality(v_cands) - cardinality(v_free);
    active := (SELECT count(*) FROM unnest(v_free) AS f(id)
               WHERE EXISTS (SELECT 1 FROM {{schema}}.commands c
                             WHERE c.instance_id = f.id AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED'))
                  OR EXISTS (SELECT 1 FROM {{schema}}.instances k
                             WHERE k.parent_id = f.id AND k.status NOT IN ('COMPLETED', 'CANCELLED')));
    unsent := 0;
    dead := 0;
    IF p_phase = 'purge' THEN
        SELECT count(*) FILTER (WHERE NOT h.has_dead), count(*) FILTER (WHERE h.has_dead) INTO unsent, dead
        FROM (SELECT f.id, bool_or(o.dead_at IS NOT NULL) AS has_dead
              FROM unnest(v_free) AS f(id)
              JOIN {{schema}}.outbox o ON o.instance_id = f.id AND o.published_at IS NULL
              WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.commands c
                                WHERE c.instance_id = f.id AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED'))
                AND NOT EXISTS (SELECT 1 FROM {{schema}}.instances k
                                WHERE k.parent_id = f.id AND k.status NOT IN ('COMPLETED', 'CANCELLED'))
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

-- Replay (fork) an instance from a step of its history: a new attempt of that step with the state it
-- had there, the old path kept in history. Every open branch is closed (a fork re-entered opens fresh
-- ones), every open command but parked signals superseded, the root moved to `p_step` at a new visit
-- with a RETRY command, and INSTANCE_REPLAYED records it with the (redacted) state as a baseline.
-- `p_expected_seq` is the history length the caller computed the state from: a history that grew
-- since is refused ('changed'), so the state is never one computed from a stale history. An instance
-- that is running or waiting is refused ('active'): cancel it first.
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

CREATE FUNCTION {{schema}}.redact_baseline() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_paths jsonb;
    v_path jsonb;
    v_state jsonb;
BEGIN
    SELECT d.plan -> 'sensitive' INTO v_paths
    FROM {{schema}}.instances i
    JOIN {{schema}}.definitions d ON d.scope = i.scope AND d.definition_id = i.definition_id AND d.version = i.version
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
