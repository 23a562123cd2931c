-- Named queries of the management API benchmark (stepstone.bench.api_list).

-- name: api_bench_spread
-- Spread the seeded instances over scopes and statuses: a quarter in scope 'acme', one in a
-- hundred FAILED (the incidents list).
UPDATE {{schema}}.instances SET
    scope = CASE WHEN abs(hashtext(id::text)) % 4 = 0 THEN 'acme' ELSE scope END,
    status = CASE WHEN abs(hashtext(id::text)) % 100 = 1 THEN 'FAILED' ELSE status END,
    created_at = created_at - make_interval(secs => abs(hashtext(id::text)) % 86400);

-- name: api_bench_tasks
-- Open human tasks on the first $1 seeded instances, in the shape the tasks section writes them: one
-- in ten assigned to 'mia', every one offered to the group 'finance', priorities spread.
INSERT INTO {{schema}}.tasks (id, instance_id, position, step, visit, scope, definition_id, status, title,
                              assignee, candidate_groups, priority, decisions, form, data, state_version,
                              created_at, updated_at)
SELECT gen_random_uuid(), i.id, '', 'approve', 1, i.scope, i.definition_id, 'OPEN', 'Approve ' || left(i.id::text, 8),
       CASE WHEN i.n % 10 = 0 THEN 'mia' END, ARRAY['finance'], 10 + (i.n % 90)::int, ARRAY['approve', 'reject'],
       '{}'::jsonb, '{}'::jsonb, 1, i.created_at, i.created_at
FROM (SELECT x.id, x.scope, x.definition_id, x.created_at, row_number() OVER (ORDER BY x.id) AS n
      FROM {{schema}}.instances x ORDER BY x.id LIMIT $1) AS i;
