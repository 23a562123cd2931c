-- Human and external tasks (docs/tasks.md, docs/external-tasks.md).
--
-- An external task whose position was cancelled (the instance cancelled, a join's losers) ended only
-- when a fetch or an answer tripped over it: until then `stepstone external list --status open` and
-- GET /external-tasks listed it OPEN, and the worker holding it kept extending its lock on work nobody
-- waited for. Now the position's cancellation cancels it at once, as it cancels the position's human
-- tasks (status CANCELLED, last_error NOT_AWAITED, as the fetch and the answer close one); an answer or
-- a lock extension with its token is then refused as not_awaited. The lazy close stays for a position
-- that moves on another way (a repair, a migration).
-- Expand only: close_position_waits is replaced with the same signature; its trigger is unchanged.

-- A cancelled position (the instance cancelled, a join's losers) cancels its open tasks, human and
-- external, and closes its subscriptions.
CREATE OR REPLACE FUNCTION {{schema}}.close_position_waits() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    UPDATE {{schema}}.tasks k SET status = 'CANCELLED', ended_at = v_now, updated_at = v_now
    WHERE k.instance_id = NEW.instance_id AND k.position = NEW.path AND k.status IN ('OPEN', 'COMPLETING');
    UPDATE {{schema}}.external_tasks x SET status = 'CANCELLED', last_error = 'NOT_AWAITED', updated_at = v_now,
        ended_at = v_now
    WHERE x.instance_id = NEW.instance_id AND x.position = NEW.path AND x.status = 'OPEN';
    UPDATE {{schema}}.subscriptions s SET status = 'CLOSED', closed_at = v_now
    WHERE s.instance_id = NEW.instance_id AND s.position = NEW.path AND s.status = 'OPEN';
    RETURN NULL;
END $$;
