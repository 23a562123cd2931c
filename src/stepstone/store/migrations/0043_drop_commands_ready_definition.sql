-- stepstone: outside a transaction
-- The contract step of migrations 0041-0042: commands_ready_definition (migration 0039) held every ready
-- command a second time beside commands_ready, and nothing of this release reads it (docs/performance.md,
-- "Ready commands indexed once"). CONCURRENTLY: workers keep claiming and committing while it goes.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_ready_definition;
