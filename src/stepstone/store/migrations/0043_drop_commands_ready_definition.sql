-- stepstone: outside a transaction
-- The contract step of migration 0041: commands_ready_definition (migration 0039) held every PENDING or
-- DEFERRED command a second time beside commands_ready (definition, available_at, id). It was kept for
-- one release because that release's predecessor looked up its next due time through it (224 ms a
-- look-up at 100,000 waiting instances without it); the release before this one reads nothing through
-- it (tests/perf/test_query_plans.py guarded that), so a rolling deploy from it loses nothing. It cost
-- every command insert, claim and settle one index entry, and a waiting instance about 50 bytes
-- (docs/performance.md, "Ready commands indexed once").
-- CONCURRENTLY: workers keep claiming and committing while it goes.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_ready_definition;
