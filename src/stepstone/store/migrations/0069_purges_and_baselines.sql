-- Retention's purge left an instance's compensation records (`compensations`: each completed saga step,
-- with what its handler kept for its compensation through `ctx.record`) for ever, after the instance, its
-- positions, commands, history and tasks had gone. Now the statement trigger on instances that deletes
-- an instance's task rows, their keys and its subscriptions (instances_deleted, migration 0049) deletes
-- them too.
-- Expand only: instances_deleted is replaced with the same signature; its trigger is unchanged.
CREATE OR REPLACE FUNCTION {{schema}}.instances_deleted() RETURNS trigger
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

-- The sweep took a parent for active while a child of it had not ended (it reports to the parent), and
-- counted only COMPLETED and CANCELLED children as ended: a parent whose child ended TIMED_OUT or
-- COMPENSATED was kept, neither archived nor purged, until that child was purged itself (by the seeded
-- windows 180 days after its end, where the parent's completed window is 30). Now an ended child is one
-- whose status is an end (is_terminal, migration 0044), as everywhere else.
-- Expand only: retention_batch (migration 0022) is replaced with the same signature.
CREATE OR REPLACE FUNCTION {{schema}}.retention_batch(p_phase text, p_limit integer, p_after uuid, p_dry_run boolean,
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
    -- Active: a command still to run, or a child that has not ended (it reports to this instance; a
    -- FAILED or COMPENSATION_FAILED one may still, once retried; one that ended COMPENSATED or TIMED_OUT
    -- reports nothing more).
    -- Then, for a purge, events a consumer has not had.
    SELECT array_agg(f.id ORDER BY f.id) INTO v_ok FROM unnest(v_free) AS f(id)
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.commands c
                      WHERE c.instance_id = f.id AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED'))
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.instances k
                      WHERE k.parent_id = f.id AND NOT {{schema}}.is_terminal(k.status))
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
                             WHERE k.parent_id = f.id AND NOT {{schema}}.is_terminal(k.status)));
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
                                WHERE k.parent_id = f.id AND NOT {{schema}}.is_terminal(k.status))
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

-- A migration writes the instance's full new state into its INSTANCE_MIGRATED history entry (a baseline),
-- and the trigger that redacts a baseline at the definition's sensitive paths took INSTANCE_STARTED entries
-- only (the worker redacts the entries of a commit itself): every value marked sensitive was kept in
-- history by a migration. Now the trigger takes INSTANCE_MIGRATED entries too; it reads the paths of the
-- version the instance migrated to, which its row names when migrate_instance writes the entry.
-- Expand only: the trigger is replaced with the same function; only its WHEN changes.
CREATE OR REPLACE TRIGGER history_redact_baseline
    BEFORE INSERT ON {{schema}}.history
    FOR EACH ROW WHEN (NEW.kind IN ('INSTANCE_STARTED', 'INSTANCE_MIGRATED') AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'plain') = 0)
    EXECUTE FUNCTION {{schema}}.redact_baseline();

-- The stranded report (`stepstone definitions stranded`, doctor, GET /definitions/stranded) counted the
-- PENDING, RUNNING and WAITING instances whose pin no worker serves: a COMPENSATING saga, which runs its
-- compensations by itself on the workers of its version, waited there unreported when none served it.
-- Now it counts COMPENSATING instances too.
-- Expand only: stranded (migration 0066) is replaced with the same signature.
CREATE OR REPLACE FUNCTION {{schema}}.stranded(p_within double precision, p_scopes text[])
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
