-- An instance that reaches a status `wait_for` returns on (COMPLETED, FAILED,
-- CANCELLED) notifies its own channel, so a waiting client wakes at once instead
-- of polling. The payload is the instance id. A separate channel from the
-- workers' wake-up, so an ending instance never makes a worker claim; cut to
-- PostgreSQL's 63-byte channel limit (a shared channel between two long schema
-- names only costs a spurious wake-up, as waiters match the id).
CREATE FUNCTION {{schema}}.notify_settled() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('stepstone.settled.' || TG_TABLE_SCHEMA, 63), NEW.id::text);
    RETURN NULL;
END $$;

CREATE TRIGGER instances_notify_settled
    AFTER UPDATE OF status ON {{schema}}.instances
    FOR EACH ROW WHEN (NEW.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
                       AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.notify_settled();
