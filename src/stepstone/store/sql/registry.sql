-- Named queries of the definitions registry (store/registry.py). Each starts with
-- "-- name: <name>"; {{schema}} is replaced by the quoted schema identifier.
-- Every lifecycle change runs in one transaction that first takes the definition id's advisory lock
-- exclusively (lock_definition), then its rows in (scope, version) order.

-- name: lock_definition
SELECT pg_advisory_xact_lock(1936028530, {{schema}}.define_lock_key($1));

-- name: lock_rows
SELECT scope, version, status FROM {{schema}}.definitions
WHERE definition_id = $1 ORDER BY scope, version FOR UPDATE;

-- name: insert_definition
-- A version not recorded yet; returns nothing when the (scope, id, version) row exists.
INSERT INTO {{schema}}.definitions (scope, definition_id, version, plan_hash, plan, registered_at, kind, status,
                                    state_model, signal_names, message_names, input_schema, document,
                                    document_format, document_digest, status_changed_at)
VALUES ($1, $2, $3, $4, $5, {{schema}}.db_now(), $6, $7, $8, $9, $10, $11, $12, $13, $14, {{schema}}.db_now())
ON CONFLICT (scope, definition_id, version) DO NOTHING
RETURNING version;

-- name: definition_row
SELECT scope, definition_id, version, plan_hash, kind, status, state_model, signal_names, message_names,
       input_schema, document_format, document_digest, registered_at, status_changed_at, publish_token
FROM {{schema}}.definitions WHERE scope = $1 AND definition_id = $2 AND version = $3;

-- name: fill_code_metadata
-- A code row recorded before the registry (or by a client) gets its metadata from the worker; one recorded
-- before the registration document kept the payload models' sensitive paths ($7, not in the plan's hash)
-- gets those, which the operator's views redact open commands and tasks by.
UPDATE {{schema}}.definitions SET state_model = COALESCE(state_model, $4),
    signal_names = CASE WHEN signal_names = '[]'::jsonb THEN $5 ELSE signal_names END,
    input_schema = COALESCE(input_schema, $6),
    plan = CASE WHEN $7::jsonb IS NOT NULL AND NOT plan ? 'sensitive_payloads'
                THEN plan || jsonb_build_object('sensitive_payloads', $7::jsonb) ELSE plan END
WHERE scope = $1 AND definition_id = $2 AND version = $3 AND kind = 'CODE';

-- name: attach_document
-- A version registered from code, without text, takes the text of a document with the same plan (its
-- publication): it is that document's version from now on, loaded from its text by the workers that
-- load published documents.
UPDATE {{schema}}.definitions SET kind = 'DOCUMENT', document = $4, document_format = $5, document_digest = $6
WHERE scope = $1 AND definition_id = $2 AND version = $3 AND document_digest IS NULL;

-- name: activate_first
-- The first version of an id recorded in the default scope becomes its current version there;
-- later versions wait for an explicit activation (deploy first, activate once every node has them).
INSERT INTO {{schema}}.definition_activations (scope, definition_id, target_scope, version, activated_at,
                                               activated_by)
SELECT 'default', $1, 'default', $2, {{schema}}.db_now(), 'first registration'
WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.definition_activations a
                  WHERE a.scope = 'default' AND a.definition_id = $1)
ON CONFLICT DO NOTHING;

-- name: set_status
UPDATE {{schema}}.definitions SET status = $4, status_changed_at = {{schema}}.db_now(),
    publish_token = CASE WHEN $4 = 'PUBLISHING' THEN $5::uuid END,
    publish_claimed_at = CASE WHEN $4 = 'PUBLISHING' THEN {{schema}}.db_now() END
WHERE scope = $1 AND definition_id = $2 AND version = $3
RETURNING status;

-- name: claim_publication
-- CANDIDATE -> PUBLISHING with a fresh token; a PUBLISHING claim at least $5 seconds old is stale
-- and is taken over.
UPDATE {{schema}}.definitions SET status = 'PUBLISHING', publish_token = $4,
    publish_claimed_at = {{schema}}.db_now(), status_changed_at = {{schema}}.db_now()
WHERE scope = $1 AND definition_id = $2 AND version = $3
  AND (status = 'CANDIDATE'
       OR (status = 'PUBLISHING' AND publish_claimed_at <= {{schema}}.db_now() - make_interval(secs => $5)))
RETURNING publish_token;

-- name: complete_publication
-- PUBLISHING -> AVAILABLE, only for the claim that holds the token (an obsolete completion fails).
UPDATE {{schema}}.definitions SET status = 'AVAILABLE', publish_token = NULL, publish_claimed_at = NULL,
    status_changed_at = {{schema}}.db_now()
WHERE scope = $1 AND definition_id = $2 AND version = $3 AND status = 'PUBLISHING' AND publish_token = $4
RETURNING status;

-- name: live_pins
-- Instances pinned to exactly this scope's row of the version that may still run, whose status is one
-- of $4 (core.model.MAY_RUN): a FAILED one runs again when it is retried, a COMPENSATING one runs its
-- compensations, and so does a COMPENSATION_FAILED one when it is retried.
SELECT count(*) FROM {{schema}}.instances
WHERE definition_scope = $1 AND definition_id = $2 AND version = $3 AND status = ANY($4::text[]);

-- name: activation_of
SELECT scope, definition_id, target_scope, version, activated_at, activated_by
FROM {{schema}}.definition_activations WHERE scope = $1 AND definition_id = $2;

-- name: put_activation
INSERT INTO {{schema}}.definition_activations (scope, definition_id, target_scope, version, activated_at,
                                               activated_by)
VALUES ($1, $2, $3, $4, {{schema}}.db_now(), $5)
ON CONFLICT (scope, definition_id) DO UPDATE SET target_scope = EXCLUDED.target_scope,
    version = EXCLUDED.version, activated_at = EXCLUDED.activated_at, activated_by = EXCLUDED.activated_by;

-- name: definition_schedules
-- The schedules of workflow $1 with their stored input: what an activation checks (store.activation_inputs).
SELECT name, scope, definition_id, input FROM {{schema}}.schedules WHERE definition_id = $1 ORDER BY name;

-- name: remove_activation
DELETE FROM {{schema}}.definition_activations WHERE scope = $1 AND definition_id = $2;

-- name: activations
SELECT scope, definition_id, target_scope, version, activated_at, activated_by
FROM {{schema}}.definition_activations
WHERE ($1::text IS NULL OR scope = $1) AND ($2::text IS NULL OR definition_id = $2)
ORDER BY definition_id, scope;

-- name: child_pin
-- The version and plan hash child $1 (of workflow $2) runs, when it exists: a child step that an operator's
-- retry runs again at the same visit names the same child, which is not started twice.
SELECT k.version, k.plan_hash FROM {{schema}}.instances k WHERE k.id = $1 AND k.definition_id = $2;

-- name: select_version
-- The version a start in scope $1 selects: the scope's activation, else the default scope's, else the
-- highest AVAILABLE version of the scope, else of the default scope. One statement, no lock: the pin
-- admission of the insert is the fence for status.
SELECT target_scope, version, plan_hash, source FROM (
    SELECT a.target_scope, a.version, d.plan_hash, 'activation' AS source, 1 AS rank
    FROM {{schema}}.definition_activations a
    JOIN {{schema}}.definitions d ON d.scope = a.target_scope AND d.definition_id = a.definition_id
                                  AND d.version = a.version
    WHERE a.scope = $1 AND a.definition_id = $2
    UNION ALL
    SELECT a.target_scope, a.version, d.plan_hash, 'default activation', 2
    FROM {{schema}}.definition_activations a
    JOIN {{schema}}.definitions d ON d.scope = a.target_scope AND d.definition_id = a.definition_id
                                  AND d.version = a.version
    WHERE a.scope = 'default' AND a.definition_id = $2
    UNION ALL
    (SELECT d.scope, d.version, d.plan_hash, 'latest available', 3 + (d.scope <> $1)::integer
     FROM {{schema}}.definitions d
     WHERE d.definition_id = $2 AND d.status = 'AVAILABLE' AND d.scope IN ($1, 'default')
     ORDER BY (d.scope <> $1), d.version DESC LIMIT 1)
) AS choices
ORDER BY rank
LIMIT 1;

-- name: list_definitions
-- Metadata only: never the document text. The function (migration 0081) plans its statement with the
-- arguments on every call, so one scope's workflow finds its index.
SELECT * FROM {{schema}}.list_definitions($1::text, $2::text, $3::text);

-- name: document_text
-- The stored text with its digest, checked by the caller on every read.
SELECT d.kind, d.document, d.document_format, d.document_digest, d.plan, d.plan_hash
FROM {{schema}}.definitions d WHERE d.scope = $1 AND d.definition_id = $2 AND d.version = $3;

-- name: heartbeat
-- What worker $1 serves now (its pins), with the time it said so. A worker that stops deletes its rows
-- (forget_worker); the rows of one that died age out of the stranded report's window.
WITH served AS (
    SELECT * FROM unnest($2::text[], $3::text[], $4::integer[], $5::text[]) AS s(scope, definition_id, version,
                                                                                 plan_hash)
), up AS (
    INSERT INTO {{schema}}.worker_plans (worker_id, scope, definition_id, version, plan_hash, started_at, seen_at)
    SELECT $1, s.scope, s.definition_id, s.version, s.plan_hash, {{schema}}.db_now(), {{schema}}.db_now()
    FROM served s
    ORDER BY s.definition_id, s.version, s.scope
    ON CONFLICT (worker_id, definition_id, version, scope) DO UPDATE
        SET seen_at = EXCLUDED.seen_at, plan_hash = EXCLUDED.plan_hash
    RETURNING definition_id
)
SELECT count(*) FROM up;

-- name: forget_worker
DELETE FROM {{schema}}.worker_plans WHERE worker_id = $1;

-- name: resume_deferred
-- A worker that serves these pins came up (or is alive): commands deferred because the workers that
-- claimed them lacked the plan become claimable now instead of after their backoff. Every heartbeat of
-- every worker runs it: its conditions on the command are commands_not_runnable's predicate, so it reads
-- that index alone, never the timers of waiting instances (migration 0033).
UPDATE {{schema}}.commands c SET available_at = {{schema}}.db_now()
FROM {{schema}}.instances i,
     unnest($1::text[], $2::integer[], $3::text[]) AS s(definition_id, version, plan_hash)
WHERE c.state = 'DEFERRED' AND c.available_at > {{schema}}.db_now() AND c.last_error LIKE 'NOT\_RUNNABLE%'
  AND i.id = c.instance_id AND i.definition_id = s.definition_id AND i.version = s.version
  AND i.plan_hash = s.plan_hash
RETURNING c.id;

-- name: stranded
-- Instances that may still run whose pinned plan no worker has served within the last $1 seconds,
-- per pin: how many, how many commands wait deferred, and when the plan was last served. Only instances
-- (and their deferred commands) of the scopes $2 when given: a scoped caller counts its own alone. The
-- function (migration 0066) plans its statement with the arguments on every call, so scopes find their
-- index.
SELECT * FROM {{schema}}.stranded($1::double precision, $2::text[]);

-- name: served
-- Which live workers serve which pins (seen within the last $1 seconds).
SELECT definition_id, version, plan_hash, count(*) AS workers, max(seen_at) AS last_seen
FROM {{schema}}.worker_plans WHERE seen_at > {{schema}}.db_now() - make_interval(secs => $1)
GROUP BY definition_id, version, plan_hash ORDER BY definition_id, version;

-- name: migration_view
-- What an in-flight migration plans from: the instance's pin, state and every position. The plan is the
-- one the instance is pinned to, by its hash: NULL when that plan is not stored (an instance admitted
-- before its id was registered), though the version may be stored with another plan (stored_plan_hash).
SELECT i.id, i.scope, i.definition_scope, i.definition_id, i.version, i.plan_hash, i.status, i.state,
       i.state_version,
       (SELECT d.plan FROM {{schema}}.definitions d WHERE d.scope = i.definition_scope
          AND d.definition_id = i.definition_id AND d.version = i.version AND d.plan_hash = i.plan_hash) AS plan,
       (SELECT d.plan_hash FROM {{schema}}.definitions d WHERE d.scope = i.definition_scope
          AND d.definition_id = i.definition_id AND d.version = i.version) AS stored_plan_hash,
       (SELECT coalesce(jsonb_agg(jsonb_build_object('path', p.path, 'status', p.status, 'step', p.step,
                                                     'visit', p.visit, 'wait', p.wait) ORDER BY p.path),
                        '[]'::jsonb)
        FROM {{schema}}.positions p WHERE p.instance_id = i.id) AS positions,
       (SELECT coalesce(jsonb_agg(DISTINCT c.step), '[]'::jsonb) FROM {{schema}}.commands c
        WHERE c.instance_id = i.id AND c.step IS NOT NULL
          AND c.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')) AS command_steps,
       (SELECT coalesce(jsonb_agg(c.name), '[]'::jsonb) FROM {{schema}}.commands c
        WHERE c.instance_id = i.id AND c.kind = 'SIGNAL' AND c.state IN ('PENDING', 'DEFERRED', 'PARKED'))
           AS open_signals,
       -- the completed saga steps whose compensation is still owed (not undone yet, or given up: a retry
       -- owes it again), which the saga runs by their step's name; a child's is its child's to run
       (SELECT coalesce(jsonb_agg(DISTINCT k.step), '[]'::jsonb) FROM {{schema}}.compensations k
        WHERE k.instance_id = i.id AND k.status IN ('PENDING', 'FAILED')
          AND k.recorded->>'kind' IS DISTINCT FROM 'child') AS owed_compensations
FROM {{schema}}.instances i WHERE i.id = $1;

-- name: pinned_contract
-- The contract of the plan an instance is pinned to: its definition scope's row of its version, when that
-- row has the instance's plan hash (no row when its plan is not stored: the version's row, if any, holds
-- another plan's names and schema).
SELECT d.scope, d.definition_id, d.version, d.plan_hash, d.signal_names, d.message_names, d.input_schema
FROM {{schema}}.instances i
JOIN {{schema}}.definitions d ON d.scope = i.definition_scope AND d.definition_id = i.definition_id
                              AND d.version = i.version AND d.plan_hash = i.plan_hash
WHERE i.id = $1;

-- name: migration_candidates
-- Instances of a definition version a batch migration considers, oldest first, a page of $4 after the
-- instance ($6 created_at, $7 id) when given: those whose status is one of $5 (core.model.MAY_RUN: every
-- status but the ends).
SELECT i.id, i.created_at FROM {{schema}}.instances i
WHERE i.definition_id = $1 AND i.version = $2 AND ($3::text IS NULL OR i.scope = $3)
  AND i.status = ANY($5::text[])
  AND ($6::timestamptz IS NULL OR (i.created_at, i.id) > ($6::timestamptz, $7::uuid))
ORDER BY i.created_at, i.id
LIMIT $4;

-- name: reserve_command_seq
-- A migration's place in the command order, taken when it is first planned (migration 0017).
SELECT nextval('{{schema}}.command_seq');

-- name: pin_admits
-- The pin admission's answer (trigger admit_pin) for instance $1 moved to version $2 with plan $3:
-- the migration's own change of the pin, which a dry run makes in a transaction it rolls back.
UPDATE {{schema}}.instances SET version = $2, plan_hash = $3 WHERE id = $1;

-- name: migrate_instance
SELECT outcome, command_id FROM {{schema}}.migrate_in_order($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12);
