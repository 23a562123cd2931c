-- The external-task list and the stranded-pins report on their custom plans, always: functions declared
-- `SET plan_cache_mode = force_custom_plan`, as 0064 did for the instance lists and counts.
--
-- Both have optional filters written `(p IS NULL OR col = p)`. A custom plan drops the ones not given and
-- reads the index of the one that is: the external tasks of one instance through external_tasks_instance,
-- the open ones of a topic through external_tasks_open, the live instances of a scope through
-- instances_scope_created. A generic plan keeps every filter and uses none of these. asyncpg prepares the
-- statements, and PostgreSQL took the generic plan after five custom ones without the filter: on such a
-- connection (20,000 rows) `stepstone external list --instance` (GET /external-tasks?instance_id=) read
-- 527 pages, a scan of the table, where the custom plan reads 9, and a scoped caller's stranded report
-- read 2,911 pages, every live instance, where it reads 144 (tests/perf/test_operator_listing_plans.py).
-- Each statement, unchanged, is the body of a function; the named queries call them; a process of the
-- previous release sends the statements themselves, so it runs on beside this one. The other operators'
-- reads with optional filters (the task inbox, dead letters, migration candidates, the probe, the stuck
-- report, a history page) kept their custom plans there: docs/performance.md, "Listings on their custom
-- plans".
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

-- The stranded-pins report (registry.sql, stranded): live instances whose pin no worker served within
-- p_within seconds, per pin; of the scopes p_scopes alone when given.
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
    WHERE i.status IN ('PENDING', 'RUNNING', 'WAITING')
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
                      WHERE w.definition_id = i.definition_id AND w.version = i.version
                        AND w.plan_hash = i.plan_hash
                        AND w.seen_at > {{schema}}.db_now() - make_interval(secs => p_within))
      AND (p_scopes IS NULL OR i.scope = ANY(p_scopes))
    GROUP BY i.definition_scope, i.definition_id, i.version, i.plan_hash
    ORDER BY i.definition_id, i.version;
END $$;
