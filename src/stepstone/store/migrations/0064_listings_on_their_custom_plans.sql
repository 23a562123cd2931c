-- The operators' instance lists and counts on their custom plans, always: functions that set
-- plan_cache_mode for their own statement alone, as 0036 did the opposite for the claim.
--
-- Every filter of a list or count is optional, written `(p IS NULL OR col = p)`. A custom plan knows the
-- values, drops the filters not given and reads the index of the one that is (a business key through
-- instances_business_key_alone, a status through instances_status_created). A generic plan knows none:
-- it keeps every filter and can use no index for any of them. The statements were prepared (asyncpg's
-- statement cache), and PostgreSQL takes a prepared statement's generic plan after five custom ones when
-- it costs less than their average: the management API's counts (one branch a status) on a connection
-- whose five counts had no business key then read 2,209 pages for one key among 20,000 instances, a
-- scan of every WAITING one, where the custom plan reads 31 (tests/perf/test_business_key_plans.py).
-- Each statement, unchanged, is now the body of a function declared `SET plan_cache_mode =
-- force_custom_plan`: planned with its arguments on every call (about 0.1-0.3 ms, an operator's read
-- that is not periodic), and nothing else on the connection changes. The named queries call them; a
-- process of the previous release sends the statements themselves, so it runs on beside this one.
-- Measured in docs/performance.md, "Listings on their custom plans".
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
