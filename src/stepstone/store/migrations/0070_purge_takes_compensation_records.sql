-- Retention's purge left an instance's compensation records (`compensations`: each completed saga step,
-- with what its handler kept for its compensation through `ctx.record`) for ever, after the instance, its
-- positions, commands, history and tasks had gone. Now the statement trigger on instances that deletes
-- an instance's task rows, their keys and its subscriptions (instances_deleted, migration 0049) deletes
-- them too.
-- Expand only: instances_deleted is replaced with the same signature; its trigger is unchanged.
CREATE OR REPLACE FUNCTION {{schema}}.instances_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {{schema}}.dedup d USING {{schema}}.tasks k, gone g
    WHERE k.instance_id = g.id AND d.kind IN ('TASK_OP', 'TASK_COMPLETE') AND d.namespace = k.id::text;
    DELETE FROM {{schema}}.tasks k USING gone g WHERE k.instance_id = g.id;
    DELETE FROM {{schema}}.external_tasks x USING gone g WHERE x.instance_id = g.id;
    DELETE FROM {{schema}}.subscriptions s USING gone g WHERE s.instance_id = g.id;
    DELETE FROM {{schema}}.compensations k USING gone g WHERE k.instance_id = g.id;
    RETURN NULL;
END $$;
