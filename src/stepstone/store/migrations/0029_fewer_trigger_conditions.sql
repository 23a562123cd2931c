-- Fewer trigger conditions on the step commit.
--
-- PostgreSQL reads a trigger's WHEN clause back from its stored form, and prepares it, once for every
-- statement that may fire the trigger: every statement, since commit_decision changes one row at a
-- time. A step commit updated an instance's status under five such clauses, settled its command under
-- one and inserted the next command under three (on the local PostgreSQL 15, 2-7 µs each, about 40 µs
-- of commit_decision's 196; docs/performance.md, "Trigger conditions"). A test in plpgsql, inside the
-- function, is planned once per session instead.
--
-- 1. What a change of an instance's status does is one trigger, whose only condition is the change
--    itself: keep the status a saga or an ended instance holds (keep_saga_status's rule, versions 6 and
--    16), and tell wait_for when the status settles (versions 4 and 6). The four triggers it replaces
--    are disabled, since migrations do not drop; the flow limits' constraint trigger stays as it is
--    (it runs at commit, so it cannot join a BEFORE trigger).
-- 2. The wake-up of a command made ready by an update (a retry, a released claim, a resumed deferral)
--    is its own trigger, without the batch test: batches only insert. commands_notify keeps inserts.
CREATE FUNCTION {{schema}}.instance_status_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Once a saga has begun only the saga decides the status, and an instance that completed or was
    -- cancelled keeps its status, unless this update reopens it: it sets or clears ended_at (a replay,
    -- a saga compensating a completed child), or a live saga moves to one of its own statuses.
    IF (OLD.saga IS NOT NULL
        OR (OLD.status IN ('COMPLETED', 'CANCELLED') AND NEW.ended_at IS NOT DISTINCT FROM OLD.ended_at))
       AND NOT (OLD.ended_at IS NULL AND (NEW.status IN ('COMPENSATING', 'COMPENSATION_FAILED')
                                          OR NEW.ended_at IS DISTINCT FROM OLD.ended_at)) THEN
        NEW.status := OLD.status;
        RETURN NEW;
    END IF;
    -- wait_for returns on these. Sent from a BEFORE trigger, as this update's last word on the row: a
    -- notification is delivered only if the transaction (and any savepoint around the update) commits.
    IF NEW.status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'COMPENSATED', 'TIMED_OUT', 'COMPENSATION_FAILED') THEN
        PERFORM pg_notify(left('stepstone.settled.' || TG_TABLE_SCHEMA, 63), NEW.id::text);
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER instances_status_changed
    BEFORE UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.instance_status_changed();

ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_keep_saga_status;
ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_keep_ended_status;
ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_notify_settled;
ALTER TABLE {{schema}}.instances DISABLE TRIGGER instances_notify_saga_settled;

CREATE OR REPLACE TRIGGER commands_notify
    AFTER INSERT ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED') AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'notified') = 0)
    EXECUTE FUNCTION {{schema}}.notify_command();

CREATE TRIGGER commands_notify_requeued
    AFTER UPDATE OF state, available_at ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED'))
    EXECUTE FUNCTION {{schema}}.notify_command();
