-- The grants of the two roles stepstone runs with besides the schema owner (docs/operations.md).
-- {{schema}} and {{role}} are quoted identifiers. `stepstone db grant ROLE` prints or applies them.

-- name: runtime
-- Workers, clients and retention: use the schema, read and write its rows, run its functions.
-- No CREATE on the schema and no ownership: this role cannot alter or drop anything.
GRANT USAGE ON SCHEMA {{schema}} TO {{role}};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {{schema}} TO {{role}};
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {{schema}} TO {{role}};
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {{schema}} TO {{role}};
ALTER DEFAULT PRIVILEGES IN SCHEMA {{schema}} GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {{role}};
ALTER DEFAULT PRIVILEGES IN SCHEMA {{schema}} GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {{role}};
ALTER DEFAULT PRIVILEGES IN SCHEMA {{schema}} GRANT EXECUTE ON FUNCTIONS TO {{role}};

-- name: read_only
-- Dashboards: read every row, change none.
GRANT USAGE ON SCHEMA {{schema}} TO {{role}};
GRANT SELECT ON ALL TABLES IN SCHEMA {{schema}} TO {{role}};
ALTER DEFAULT PRIVILEGES IN SCHEMA {{schema}} GRANT SELECT ON TABLES TO {{role}};

-- name: maintain
-- PostgreSQL 17 and later, with the runtime grants: MAINTAIN on the engine's hot tables, so that the
-- workers may ANALYZE them while the database is young (docs/internals.md, "Statistics of a fresh
-- database"); without it they leave that to autovacuum. MAINTAIN allows VACUUM, ANALYZE, REINDEX,
-- CLUSTER and LOCK TABLE on these tables; it alters and creates nothing.
GRANT MAINTAIN ON {{schema}}.instances, {{schema}}.positions, {{schema}}.commands, {{schema}}.history TO {{role}};
