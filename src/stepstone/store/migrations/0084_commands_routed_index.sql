-- stepstone: outside a transaction
-- The routed ready commands: PENDING or DEFERRED commands queued under a route (`definition_id@version@
-- plan_hash`, command_route), which only a worker's deferral of a command whose plan it lacks puts there
-- (and what continues in that row). The claim (migration 0085) asks it whether anything is routed before
-- it probes a worker's routes. CONCURRENTLY: workers keep claiming and committing while it builds; the DROP
-- first clears an invalid index that an interrupted build leaves behind.
DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.commands_routed;
CREATE INDEX CONCURRENTLY commands_routed ON {{schema}}.commands (definition)
    WHERE (state IN ('PENDING', 'DEFERRED')) IS TRUE AND strpos(definition, '@') > 0;
