-- Named queries of the retention benchmark (stepstone.bench.retention). {{schema}} is the schema.

-- name: complete_seeded
-- The seeded waiting instances $1..$2 (bench.sql seed_waiting_*) as the engine leaves a completed
-- one: instance and root position COMPLETED, its timer superseded.
WITH ids AS (SELECT (lpad(to_hex(1700000000000 + g), 12, '0') || '7' || substr(md5('w' || g), 14, 3) || '8' || substr(md5('w' || g), 18, 15))::uuid AS id FROM generate_series($1::bigint, $2::bigint) AS g),
inst AS (
    UPDATE {{schema}}.instances i SET status = 'COMPLETED', ended_at = now(), updated_at = now()
    FROM ids WHERE i.id = ids.id RETURNING i.id
), pos AS (
    UPDATE {{schema}}.positions p SET status = 'COMPLETED', wait = NULL
    FROM ids WHERE p.instance_id = ids.id RETURNING p.instance_id
)
UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', settled_at = now()
FROM ids WHERE c.instance_id = ids.id AND c.state = 'PENDING';

-- name: analyze
ANALYZE;
