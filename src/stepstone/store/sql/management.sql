-- Named queries of the management API and the web UI (stepstone.store.management).
-- {{schema}} is replaced by the quoted schema identifier when the file is loaded.
-- A scopes argument is a text[] of the scopes the caller may see, or NULL for every scope.
-- Lists are keyset-paginated: the caller passes the last row's key and gets the rows after it.

-- name: token_insert
INSERT INTO {{schema}}.api_tokens (id, name, token_hash, role, scope, created_at, created_by, groups)
VALUES ($1, $2, $3, $4, $5, {{schema}}.db_now(), $6, $7)
RETURNING id, name, role, scope, created_at, created_by, revoked_at, groups;

-- name: token_list
SELECT id, name, role, scope, created_at, created_by, revoked_at, groups
FROM {{schema}}.api_tokens
WHERE $1 OR revoked_at IS NULL
ORDER BY created_at, id;

-- name: token_revoke
-- Revoke the token $1 (idempotent: a revoked token keeps its first revocation time).
UPDATE {{schema}}.api_tokens SET revoked_at = COALESCE(revoked_at, {{schema}}.db_now())
WHERE id = $1
RETURNING id, name, role, scope, created_at, created_by, revoked_at, groups;

-- name: token_by_hash
SELECT id, name, role, scope, groups FROM {{schema}}.api_tokens WHERE token_hash = $1 AND revoked_at IS NULL;

-- name: token_active_count
SELECT count(*) FROM {{schema}}.api_tokens WHERE revoked_at IS NULL;

-- name: instance_scope
SELECT scope FROM {{schema}}.instances WHERE id = $1;

-- name: instance_scopes
SELECT id, scope FROM {{schema}}.instances WHERE id = ANY($1::uuid[]);

-- name: instance_redactions
-- What the views redact each instance by: the sensitive paths of the plan it is pinned to (its plan hash, in
-- the registration its pin was admitted against, as operations.sql's instance_extra reads them). An instance
-- whose plan is not stored (admitted before its id was registered; the version may since be stored with
-- other code) has paths no one knows: it is redacted by every path a stored plan of its workflow marks, in
-- its definition scope or its own (the version's row among them, so never less than that row).
SELECT i.id,
       CASE WHEN o.plan IS NOT NULL THEN o.plan -> 'sensitive'
            ELSE {{schema}}.stored_sensitive_paths(i.scope, i.definition_scope, i.definition_id, 'sensitive')
       END AS sensitive,
       CASE WHEN o.plan IS NOT NULL THEN o.plan -> 'sensitive_payloads'
            ELSE {{schema}}.stored_sensitive_paths(i.scope, i.definition_scope, i.definition_id, 'sensitive_payloads')
       END AS sensitive_payloads
FROM {{schema}}.instances i
LEFT JOIN {{schema}}.definitions o
       ON o.scope = i.definition_scope AND o.definition_id = i.definition_id AND o.version = i.version
      AND o.plan_hash = i.plan_hash
WHERE i.id = ANY($1::uuid[]);

-- name: instances_page
-- Newest first on (created_at, id): scopes $1, status $2, definition $3, business key $4,
-- after ($5, $6), at most $7 rows; archived instances only when $8 (is_archived, as the operations'
-- find). A single scope reads instances_scope_created backwards. The statement is the function's
-- (migration 0064): planned with its arguments on every call, so a filter given reads its index.
SELECT * FROM {{schema}}.instances_page($1::text[], $2::text, $3::text, $4::text, $5::timestamptz, $6::uuid,
                                        $7::bigint, $8::boolean);

-- name: instance_count
-- How many instances of the status /*status*/ of the scopes $1 (and definition $2, business key $5)
-- there are, counting at most $3 + 1: a status with more shows as $3 + 1 ("more than $3"), so the counts
-- cost about the same at a million instances as at a thousand. store/management.py joins one branch per
-- status (core.model.STATUSES) into `instance_counts`. Archived instances count only when $4 (as
-- instances_page's $8). The function (migration 0064) plans its count with the status and the filters
-- known on every call, so the planner knows how common the status is (a rare one is read through
-- instances_status_created) and a business key $5, which matches few instances, is looked up: no branch
-- may scan the table for it (tests/perf/test_management_query_plans.py, test_business_key_plans.py).
SELECT '/*status*/' AS status, {{schema}}.instance_count('/*status*/', $1::text[], $2::text, $3::bigint, $4::boolean,
                                                         $5::text) AS n

-- name: history_page
-- History of instance $1 oldest first, entries after seq $2, at most $3; only the kinds $4 when given
-- (core.model.FAILURE_KINDS).
SELECT h.seq, h.at, h.kind, h.position, h.step, h.visit, h.command_id, h.actor, h.data
FROM {{schema}}.history h
WHERE h.instance_id = $1 AND h.seq > $2
  AND ($4::text[] IS NULL OR h.kind = ANY ($4::text[]))
ORDER BY h.seq
LIMIT $3;

-- name: commands_page
-- Commands of instance $1 by id, after id $2, at most $3; only the states $4 when given.
SELECT c.id, c.position, c.seq, c.kind, c.state, c.step, c.visit, c.name, c.payload, c.dedup_key, c.attempt,
       c.claims, c.deferrals, c.available_at, c.claimed_by, c.last_error, c.created_at, c.settled_at
FROM {{schema}}.commands c
WHERE c.instance_id = $1 AND c.id > $2
  AND ($4::text[] IS NULL OR c.state = ANY($4::text[]))
ORDER BY c.id
LIMIT $3;

-- name: dead_commands_page
-- Dead-lettered commands (their instance FAILED) of the scopes $1, newest first, ids below $2, at most $3;
-- only of definition $4 when given.
SELECT c.id, c.instance_id, i.scope, i.definition_id, i.version, i.status AS instance_status, c.position,
       c.kind, c.step, c.visit, c.attempt, c.claims, c.last_error, c.created_at, c.settled_at
FROM {{schema}}.commands c
JOIN {{schema}}.instances i ON i.id = c.instance_id
WHERE c.state = 'DEAD'
  AND ($1::text[] IS NULL OR i.scope = ANY($1::text[]))
  AND ($4::text IS NULL OR i.definition_id = $4)
  AND ($2::bigint IS NULL OR c.id < $2)
ORDER BY c.id DESC
LIMIT $3;

-- name: instance_outbox
-- Events instance $1 staged, by id, after id $2, at most $3.
SELECT o.id, o.event_id, o.type, o.key, o.payload, o.created_at, o.published_at, o.dead_at, o.attempts,
       o.next_attempt_at, o.last_error
FROM {{schema}}.outbox o
WHERE o.instance_id = $1 AND o.id > $2
ORDER BY o.id
LIMIT $3;

-- name: definitions_page
-- Registered definitions of the scopes $1 by (scope, definition, version), after ($2, $3, $4), at most $5.
SELECT d.scope, d.definition_id, d.version, d.plan_hash, d.registered_at
FROM {{schema}}.definitions d
WHERE ($1::text[] IS NULL OR d.scope = ANY($1::text[]))
  AND ($2::text IS NULL OR (d.scope, d.definition_id, d.version) > ($2, $3, $4))
ORDER BY d.scope, d.definition_id, d.version
LIMIT $5;

-- name: definition_plan
SELECT d.scope, d.definition_id, d.version, d.plan_hash, d.plan, d.registered_at
FROM {{schema}}.definitions d
WHERE d.scope = $1 AND d.definition_id = $2 AND d.version = $3;

-- name: instance_stamp
-- What the UI's live stream compares to see that an instance changed.
SELECT status, updated_at FROM {{schema}}.instances WHERE id = $1;
