-- stepstone: outside a transaction
-- The contract step of the positions change (migration 0002): the per-instance queue index
-- `commands_queue (instance_id, seq, id)` gave way to `commands_position_queue (instance_id, position,
-- seq, id)`, and every release since has read the queue through the latter. The old index was kept
-- for the release that introduced positions (expand/contract); it still cost every command insert,
-- claim and settle one index entry (docs/performance.md, "Contract: the superseded queue index").
-- CONCURRENTLY: workers keep claiming and committing while it goes.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_queue;
