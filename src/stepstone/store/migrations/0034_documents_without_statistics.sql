-- The engine's documents (state, waits, errors, payloads, history data) carry no column statistics.
-- No statement filters, joins or sorts on a document, so the planner never reads what ANALYZE gathers
-- for them, while gathering it was most of what an ANALYZE of history cost: jsonb values are sorted to
-- build their histogram. At 15,000 history rows ANALYZE of history took 121-131 ms before and 33-35 ms
-- after (three calls each, docs/performance.md, "Documents without statistics"). A worker analyzes
-- the young hot tables as they double (`refresh_statistics`) and autovacuum re-analyzes them later,
-- each time on the server's cores that commit the workflows' steps. The other columns keep the default
-- target. Only the catalog changes (SHARE UPDATE EXCLUSIVE, which commits and claims do not wait for).
ALTER TABLE {{schema}}.instances ALTER COLUMN state SET STATISTICS 0,
                                 ALTER COLUMN wait SET STATISTICS 0,
                                 ALTER COLUMN error SET STATISTICS 0,
                                 ALTER COLUMN saga SET STATISTICS 0,
                                 ALTER COLUMN context SET STATISTICS 0;
ALTER TABLE {{schema}}.positions ALTER COLUMN wait SET STATISTICS 0,
                                 ALTER COLUMN error SET STATISTICS 0,
                                 ALTER COLUMN item SET STATISTICS 0;
ALTER TABLE {{schema}}.commands ALTER COLUMN payload SET STATISTICS 0,
                                ALTER COLUMN context SET STATISTICS 0;
ALTER TABLE {{schema}}.history ALTER COLUMN data SET STATISTICS 0;
