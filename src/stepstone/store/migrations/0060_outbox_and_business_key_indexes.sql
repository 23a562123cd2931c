-- stepstone: outside a transaction
-- Two partial indexes, each built CONCURRENTLY, so that starts, commits and the relays go on while they
-- build (a plain CREATE INDEX holds off every write of its table for the build, on a large table for
-- minutes); each DROP first clears the invalid index an interrupted build leaves behind.
--
-- outbox_pending_unkeyed: the unkeyed unpublished events in id order, from which the relay's claim takes
-- them when it skips past keys held back (migration 0059).
--
-- instances_business_key_alone: a business key without a workflow finds its instances directly
-- (docs/operations.md, "Finding instances").
--
-- The only index of business keys, instances_business_key (the uniqueness of a key per scope and
-- definition), leads with (scope, definition_id). The instance list and counts given a business key but
-- no workflow (`stepstone list --business-key K`, GET /instances?business_key=K: operations.sql's
-- find_instances and count_instances, management.sql's instances_page and instance_counts) read the
-- whole of that index for the few rows with that key, or of one scope's part of it: 245 pages of the
-- index for one row among 20,000 instances over 5,000 scopes on PostgreSQL 15 (191 on 18, whose skip
-- scan probes each scope), growing with the table
-- (tests/perf/test_business_key_plans.py). An index on the key alone finds them in a few pages. It is
-- written only for instances that have a key, once at the start (the key never changes).
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.outbox_pending_unkeyed;
CREATE INDEX CONCURRENTLY outbox_pending_unkeyed ON {{schema}}.outbox (id) WHERE published_at IS NULL AND key IS NULL;
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.instances_business_key_alone;
CREATE INDEX CONCURRENTLY instances_business_key_alone ON {{schema}}.instances (business_key)
    WHERE business_key IS NOT NULL;
