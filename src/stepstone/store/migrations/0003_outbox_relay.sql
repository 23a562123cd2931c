-- The outbox relay: the inserting transaction of every event (the visibility
-- horizon), delivery bookkeeping (attempts, backoff, dead letters), the relay's
-- lease on the rows it is publishing, trace context, and a wake-up channel.
-- Additive only: rows staged before this migration have a NULL xid, which the
-- relay reads as "committed long ago" (this migration's lock waited for them).
ALTER TABLE {{schema}}.outbox
    ADD COLUMN xid xid8,
    ADD COLUMN trace_context jsonb,
    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN last_error text,
    ADD COLUMN dead_at timestamptz,
    ADD COLUMN claim_token uuid,
    ADD COLUMN claimed_until timestamptz,
    ADD COLUMN claimed_by text;
-- Set after the column exists, so existing rows are not rewritten with this transaction's id.
ALTER TABLE {{schema}}.outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

CREATE INDEX outbox_pending_key ON {{schema}}.outbox (key, id) WHERE published_at IS NULL AND key IS NOT NULL;
CREATE INDEX outbox_dead ON {{schema}}.outbox (id) WHERE dead_at IS NOT NULL AND published_at IS NULL;
CREATE INDEX outbox_unsent_instance ON {{schema}}.outbox (instance_id) WHERE published_at IS NULL;

-- One notification per inserting statement (deduplicated per transaction), a hint only.
CREATE FUNCTION {{schema}}.notify_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('stepstone_outbox_' || TG_TABLE_SCHEMA, 63), '');
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON {{schema}}.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.notify_outbox();
