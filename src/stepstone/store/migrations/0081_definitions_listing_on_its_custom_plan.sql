-- The definitions listing on its custom plan, always: a function declared `SET plan_cache_mode =
-- force_custom_plan`, as 0064 and 0066 did for the instance lists, the external-task list and the stranded
-- report.
--
-- `stepstone definitions list` and GET /definitions (Registry.list_definitions) filter by scope, workflow
-- and status, each optional, written `($n IS NULL OR col = $n)`. A custom plan of one version's rows (a
-- scope and a workflow) reads the primary key; a generic plan keeps every filter and uses no index.
-- asyncpg prepares the statement, and PostgreSQL took the generic plan after five custom ones without a
-- filter: on such a connection (3,000 versions of 300 workflows in 50 scopes) the rows of one scope's
-- workflow read 61 pages, a scan of the table, where the custom plan reads 15
-- (tests/perf/test_operator_listing_plans.py). The statement, unchanged, is the function's body; the named
-- query calls it; a process of the previous release sends the statement itself, so it runs on beside this
-- one. The schedules listing kept its index by another shape (one schedule is a statement of its own,
-- store/scheduling.py); the other registry, schedule and flow-limit listings read the same pages on either
-- plan: docs/performance.md, "Listings on their custom plans".
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
