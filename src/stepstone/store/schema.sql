-- The current full schema: must equal the result of applying every file in migrations/ in order
-- (tests/test_schema_matches_migrations.py checks it).
CREATE TABLE {{schema}}.placeholder (
    id int PRIMARY KEY
);
