-- Named queries of `stepstone doctor` (not on the engine's hot path). Each starts with
-- "-- name: <name>"; {{schema}} is replaced by the quoted schema identifier.

-- name: server_version
SELECT current_setting('server_version');

-- name: server_version_num
-- As a number (170000 for 17.0): what a feature of a later release is checked against.
SELECT current_setting('server_version_num')::integer;

-- name: deferred_pins
-- Commands DEFERRED because the workers that claimed them lack their plan (the
-- worker's reason starts with the kind NOT_RUNNABLE), grouped by the pin of their
-- instance: how many, the oldest command's creation, the most deferrals of one.
SELECT i.scope, i.definition_id, i.version, i.plan_hash,
       count(*) AS commands, min(c.created_at) AS oldest, max(c.deferrals) AS deferrals
FROM {{schema}}.commands c
JOIN {{schema}}.instances i ON i.id = c.instance_id
WHERE c.state = 'DEFERRED' AND c.last_error LIKE 'NOT\_RUNNABLE%'
GROUP BY i.scope, i.definition_id, i.version, i.plan_hash
ORDER BY oldest, i.definition_id, i.version;
