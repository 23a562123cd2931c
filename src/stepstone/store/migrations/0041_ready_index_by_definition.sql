-- stepstone: outside a transaction
-- One index of ready commands, by definition: commands_ready (definition, available_at, id), replacing
-- commands_ready (available_at, id) of version 1 and commands_ready_definition of migration 0039, which
-- held every PENDING or DEFERRED command twice. commands_ready_definition stays for one release: the
-- previous release's workers look up their next due time through it during a rolling deploy (without
-- it, 224 ms a look-up at 100,000 waiting instances instead of under 1 ms); the next release's contract
-- step drops it. The old commands_ready goes now: of the previous release only the health sample read it
-- (one statement a sample interval, fleet-wide), and the name is this index's. Its predicate is written
-- `(state IN ('PENDING', 'DEFERRED')) IS TRUE`, and only the statements that walk ready work say exactly
-- that (the claim, the next due time, the health sample, `ready_definitions`: migration 0042): a plain
-- state test cannot prove it, and their test proves no other partial index's predicate. So a walk reads
-- this index whatever the statistics say; with a plain predicate, a claim planned when ANALYZE had found
-- the queue empty read the whole of commands_position_queue instead, since both looked free
-- (tests/perf/test_query_plans.py; docs/performance.md, "Ready commands indexed once").
-- CONCURRENTLY: workers keep claiming and committing while it builds; the DROP first clears an invalid
-- index that an interrupted build leaves behind (and, the first time, the old index of this name).
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_ready;
CREATE INDEX CONCURRENTLY commands_ready ON {{schema}}.commands (definition, available_at, id)
    WHERE (state IN ('PENDING', 'DEFERRED')) IS TRUE;
