-- Redaction of command payloads: a signal's or a message's payload may hold values its workflow
-- marks sensitive (`wait(..., payloads=...)`). The handler needs them, so they stay in the command
-- while it is open; the commit that settles the command for good stores the payload with those
-- values replaced (core/redaction.py computes it). Only the claimed command's own row changes, which
-- this commit already holds, so the lock order is untouched.
CREATE FUNCTION {{schema}}.redact_claimed_payload(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {{schema}}.commands c SET payload = NULLIF(p_items -> -1 -> 'payload', 'null'::jsonb)
    WHERE c.id = (p_commit->>'command')::bigint AND c.instance_id = (p_commit->>'instance')::uuid;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('redacted_payloads', 60, 'redact_claimed_payload');
