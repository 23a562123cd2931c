-- stepstone: outside a transaction
-- The four indexes behind newest-first listings of instances become ascending; a listing reads them
-- backwards (an index scan runs either way, so every plan keeps its shape). Why: instances are created
-- in time order, so a new entry of a descending index always lands on the leftmost leaf of its group,
-- and a page split there leaves a half-empty page behind for good; an ascending index takes new entries
-- at the right edge, where PostgreSQL splits a full page 90/10 (docs/performance.md, "Listing indexes").
-- Each new index is built CONCURRENTLY before the old one goes, so listings keep an index throughout.
-- A run interrupted half-way runs the file again: the DROP of the new name first clears an invalid
-- index that an interrupted CREATE INDEX CONCURRENTLY leaves behind.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_created;
CREATE INDEX CONCURRENTLY instances_created ON {{schema}}.instances (created_at, id);
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_newest;
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_status_created;
CREATE INDEX CONCURRENTLY instances_status_created ON {{schema}}.instances (status, created_at, id);
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_status_newest;
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_scope_created;
CREATE INDEX CONCURRENTLY instances_scope_created ON {{schema}}.instances (scope, created_at, id);
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_scope_newest;
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_definition_created;
CREATE INDEX CONCURRENTLY instances_definition_created ON {{schema}}.instances (definition_id, created_at, id);
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_definition_newest;
