-- One test of "archived": an instance past its retention window has archived_at set; one that changed
-- again since (a retry, a replay) counts as not archived, shows in every list and is archived afresh.
-- The operations' filter (find, counts, bulk changes) and the management API's list and counts (which
-- showed archived instances: `GET /instances`, the UI's list) ask this one function; it is inlined
-- where it is used, so the plans are those of the expression written out.
-- Expand only: a new function.
CREATE FUNCTION {{schema}}.is_archived(p_archived_at timestamptz, p_ended_at timestamptz,
                                       p_updated_at timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_archived_at IS NOT NULL AND p_archived_at >= COALESCE(p_ended_at, p_updated_at) $$;
