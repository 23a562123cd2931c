-- Named queries of the management API benchmark (stepstone.bench.api_list).

-- name: api_bench_spread
-- Spread the seeded instances over scopes and statuses: a quarter in scope 'acme', one in a
-- hundred FAILED (the incidents list).
UPDATE {{schema}}.instances SET
    scope = CASE WHEN abs(hashtext(id::text)) % 4 = 0 THEN 'acme' ELSE scope END,
    status = CASE WHEN abs(hashtext(id::text)) % 100 = 1 THEN 'FAILED' ELSE status END,
    created_at = created_at - make_interval(secs => abs(hashtext(id::text)) % 86400);
