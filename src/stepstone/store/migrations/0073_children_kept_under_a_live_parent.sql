-- The sweep looked at an instance's children (a child that has not ended keeps its parent), never at its
-- parent: with a window for a child's waiting class (`stepstone retention set W waiting ...`), a WAITING
-- child its parent waited for was archived, then purged, and the parent waited for ever (a signal or a
-- message for the child found no instance). Now an instance whose parent has not ended (is_terminal,
-- migration 0044) is active as one with a live child is: kept, counted in `active`, in both phases. A
-- tree is swept from its root down: the root once past its window and with every child ended, each child
-- once its parent has ended. The body is the same sweep otherwise, with the guards stated once (v_idle)
-- where they were stated three times.
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
