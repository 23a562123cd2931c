-- A published message's row keeps its payload only while it is buffered (it is delivered from there).
-- Delivered, its payload lives in the MESSAGE command of each instance it reached, which the commit
-- settling it stores redacted by that workflow's payload model (migration 0015); dropped, nothing
-- needs it; expired (the retention sweep marks a buffered message past its TTL EXPIRED), neither.
-- A trigger, so every path that writes the row (publish_message, a buffered message taken by a new
-- subscription, the sweep) obeys it without repeating it.
CREATE FUNCTION {{schema}}.message_payload_while_buffered() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> 'BUFFERED' THEN
        NEW.payload := NULL;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER messages_payload_while_buffered BEFORE INSERT OR UPDATE OF status, payload ON {{schema}}.messages
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.message_payload_while_buffered();

UPDATE {{schema}}.messages SET payload = NULL WHERE status <> 'BUFFERED' AND payload IS NOT NULL;
