-- stepstone: outside a transaction
-- Commands deferred because the workers that claimed them lacked the plan (NOT_RUNNABLE) get an index
-- of their own. Every worker looks for them at start and on each heartbeat (registry.sql,
-- resume_deferred: every 10 s by default) to make them claimable at once, and no index led to them
-- alone: with 200,000 waiting instances the plan read every pending timer through commands_ready to keep
-- none (49 ms, 4,216 pages), and with 1,000,000 it read every instance and looked up each one's queue
-- (1.6 s and 4 million buffers a call, each heartbeat of each worker; docs/performance.md, "Deferred
-- commands, found by an index of their own"). The partial index holds only such commands, which are
-- few, and nothing on the path of a claim or a commit ever enters it. CONCURRENTLY: workers keep
-- claiming and committing while it builds; the DROP first clears an invalid index that an interrupted
-- build leaves behind.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_not_runnable;
CREATE INDEX CONCURRENTLY commands_not_runnable ON {{schema}}.commands (available_at, id)
    WHERE state = 'DEFERRED' AND last_error LIKE 'NOT\_RUNNABLE%';
