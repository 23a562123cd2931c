-- The execution probe's listing of open commands on its custom plan, always: a function declared
-- `SET plan_cache_mode = force_custom_plan`, as 0064 and 0066 did for the other operators' reads.
--
-- The probe (stepstone probe, GET /operator/probe) lists the first 1,000 open commands by instance
-- (operations.sql, open_commands). asyncpg prepares the statement, and PostgreSQL took its generic plan
-- after five custom ones at that limit: on such a connection (the API server's pool; 20,000 waiting
-- instances, tests/perf/test_operator_listing_plans.py's seed) the listing of every instance read 125,911
-- pages where its custom plan reads 3,745, and the listing of one business key read 66,069 where its
-- custom plan reads 17 (a scan of every command). The statement, unchanged but for the filters' names, is
-- the function's body; the named query calls it; a process of the previous release sends the statement
-- itself, so it runs on beside this one. The flags state probe_columns of operations.sql again and the
-- filters instance_filter: tests/ops/test_listing_functions.py checks both. What the probe says is busy
-- comes from its own statement (busy_commands), which keeps its index reads on either plan.
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
