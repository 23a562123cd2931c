-- Named queries of human tasks and messages (migration 0007). {{schema}} is the quoted schema.
-- The inbox query is composed of fragments named here, never of text written elsewhere:
--   <task_select> <one task_mode_*> <task_filters> <task_page>, or <task_count> <mode> <task_filters>
-- Parameters:
--   $1 user  $2 groups  $3 workflow  $4 priority at least  $5 due before  $6 candidate group
--   $7 text in title  $8 follow-up before  $9 hide later follow-ups (db_now)  $10 scope  $11 any of these scopes
--   $12-$14 the keyset cursor (priority, created_at, id)  $15 limit

-- name: task_select
SELECT t.id, t.instance_id, t.position, t.step, t.visit, t.definition_id, t.status, t.title, t.description,
t.assignee, t.owner, t.delegation, t.candidate_users, t.candidate_groups, t.priority, t.decisions, t.form,
t.data, t.state_version, t.require_version_stability, t.due_at, t.follow_up_at, t.reminded_at, t.escalated_at,
t.completion, t.created_at, t.updated_at, t.ended_at, t.scope
FROM {{schema}}.tasks t
WHERE

-- name: task_count
SELECT count(*) FROM {{schema}}.tasks t
WHERE

-- name: task_mode_inbox
-- Assigned to the user, or unassigned and offered to the user or one of their groups.
t.status IN ('OPEN', 'COMPLETING')
AND (t.assignee = $1::text
     OR (t.assignee IS NULL AND (t.candidate_users @> ARRAY[$1::text] OR t.candidate_groups && $2::text[])))

-- name: task_mode_assigned
t.status IN ('OPEN', 'COMPLETING') AND t.assignee = $1::text AND $2::text[] IS NOT DISTINCT FROM $2::text[]

-- name: task_mode_candidate
t.status IN ('OPEN', 'COMPLETING') AND t.assignee IS NULL
AND (t.candidate_users @> ARRAY[$1::text] OR t.candidate_groups && $2::text[])

-- name: task_mode_all
-- Every open task (an operator's view), optionally of one assignee or offered to some groups.
t.status IN ('OPEN', 'COMPLETING') AND ($1::text IS NULL OR t.assignee = $1::text)
AND ($2::text[] IS NULL OR t.candidate_groups && $2::text[])

-- name: task_filters
AND ($3::text IS NULL OR t.definition_id = $3::text)
AND ($4::integer IS NULL OR t.priority >= $4::integer)
AND ($5::timestamptz IS NULL OR t.due_at < $5::timestamptz)
AND ($6::text IS NULL OR t.candidate_groups @> ARRAY[$6::text])
AND ($7::text IS NULL OR strpos(lower(t.title), lower($7::text)) > 0)
-- A task with a follow-up date is put aside until then (no follow-up date: never put aside).
AND ($8::timestamptz IS NULL OR t.follow_up_at IS NULL OR t.follow_up_at <= $8::timestamptz)
AND (NOT $9::boolean OR t.follow_up_at IS NULL OR t.follow_up_at <= {{schema}}.db_now())
AND ($10::text IS NULL OR t.scope = $10::text)
AND ($11::text[] IS NULL OR t.scope = ANY ($11::text[]))

-- name: task_page
AND ($12::integer IS NULL OR t.priority < $12::integer
     OR (t.priority = $12::integer AND (t.created_at, t.id) > ($13::timestamptz, $14::uuid)))
ORDER BY t.priority DESC, t.created_at, t.id
LIMIT $15

-- name: get_task
SELECT t.*, i.version, i.state_version AS current_version, i.status AS instance_status
FROM {{schema}}.tasks t JOIN {{schema}}.instances i ON i.id = t.instance_id
WHERE t.id = $1;

-- name: instance_tasks
SELECT t.id, t.position, t.step, t.visit, t.status, t.title, t.assignee, t.created_at, t.ended_at
FROM {{schema}}.tasks t WHERE t.instance_id = $1 ORDER BY t.created_at, t.id;

-- name: task_assign
SELECT outcome, task FROM {{schema}}.task_assign($1, $2, $3, $4, $5, $6, $7, $8, $9);

-- name: task_complete
SELECT outcome, task, changed FROM {{schema}}.task_complete($1, $2, $3, $4, $5, $6, $7, $8, $9);

-- name: task_key_seen
-- A task operation's idempotency key seen before: 'duplicate' (same request), 'conflict' (another), or NULL.
SELECT {{schema}}.task_key_seen($1, $2, $3, $4) AS seen;

-- name: task_reassign_all
SELECT reassigned, skipped FROM {{schema}}.task_reassign_all($1, $2, $3, $4, $5);

-- name: publish_message
-- cap: the buffer's limit (max_open_signals), which a 'full' outcome reports.
SELECT outcome, deliveries, expires_at, status, {{schema}}.max_open_signals() AS cap
FROM {{schema}}.publish_message($1, $2, $3, $4, $5, $6, $7);

-- name: start_or_signal
-- $15 the caller's durable context, $16/$17 the instance deadline (instant, seconds), $18 the start
-- step's deadline (seconds): used only when this call starts the instance (migration 0021).
SELECT outcome, instance_id, started, command_id, status
FROM {{schema}}.start_or_signal_with($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
                                     $18);

-- name: signal_started_instance
-- Whether the start-or-signal call that recorded instance $1's signal with dedup key $2 started the
-- instance (migration 0054's dedup.started_instance): what a repeat of that call answers as `started`.
SELECT COALESCE((SELECT started_instance FROM {{schema}}.dedup
                 WHERE kind = 'SIGNAL' AND namespace = $1::text AND key = $2), false) AS started;

-- name: business_key_instance
SELECT id FROM {{schema}}.instances WHERE scope = $1 AND definition_id = $2 AND business_key = $3;

-- name: save_task_filter
-- Saving a name again replaces its filter (created_at stays the first save's).
INSERT INTO {{schema}}.task_filters AS f (scope, owner, name, mode, filter, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, {{schema}}.db_now(), {{schema}}.db_now())
ON CONFLICT (scope, owner, name) DO UPDATE SET mode = EXCLUDED.mode, filter = EXCLUDED.filter,
    updated_at = EXCLUDED.updated_at
RETURNING f.scope, f.owner, f.name, f.mode, f.filter, f.created_at, f.updated_at;

-- name: saved_task_filters
SELECT f.scope, f.owner, f.name, f.mode, f.filter, f.created_at, f.updated_at
FROM {{schema}}.task_filters f WHERE f.scope = $1 AND f.owner = $2 ORDER BY f.name;

-- name: saved_task_filter
SELECT f.scope, f.owner, f.name, f.mode, f.filter, f.created_at, f.updated_at
FROM {{schema}}.task_filters f WHERE f.scope = $1 AND f.owner = $2 AND f.name = $3;

-- name: delete_task_filter
DELETE FROM {{schema}}.task_filters f WHERE f.scope = $1 AND f.owner = $2 AND f.name = $3 RETURNING f.name;
