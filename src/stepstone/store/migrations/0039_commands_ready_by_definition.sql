-- stepstone: outside a transaction
-- The ready commands of each definition, oldest first: the walk of a claim that serves some workflows
-- (migration 0040). CONCURRENTLY: workers keep claiming and committing while it builds; the DROP first
-- clears an invalid index that an interrupted build leaves behind.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_ready_definition;
CREATE INDEX CONCURRENTLY commands_ready_definition ON {{schema}}.commands (definition, available_at, id)
    WHERE state IN ('PENDING', 'DEFERRED');
