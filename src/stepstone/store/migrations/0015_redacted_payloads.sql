-- Redaction of command payloads: a signal's, message's or task decision's payload may hold values its
-- workflow marks sensitive (`wait(..., payloads=...)`, `task(..., payloads=...)`). The handler needs
-- them, so they stay whole while the command is open; the commit that settles the command for good
-- stores its payload with those values replaced (core/redaction.py computes it), and for a task
-- completion the copy the task row keeps. Rows it changes: the claimed command, which this commit
-- holds already, then the task (a feature row, after the commands in the lock order, which the
-- commit's task section has locked already).
CREATE FUNCTION {{schema}}.redact_claimed_payload(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_item jsonb := p_items -> -1;
BEGIN
    UPDATE {{schema}}.commands c SET payload = NULLIF(v_item -> 'payload', 'null'::jsonb)
    WHERE c.id = (p_commit->>'command')::bigint AND c.instance_id = (p_commit->>'instance')::uuid;
    IF v_item ->> 'task_id' IS NOT NULL THEN
        UPDATE {{schema}}.tasks k SET completion = jsonb_set(k.completion, '{payload}', v_item -> 'task_payload')
        WHERE k.id = (v_item ->> 'task_id')::uuid AND k.instance_id = (p_commit->>'instance')::uuid
          AND k.completion ? 'payload';
    END IF;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('redacted_payloads', 60, 'redact_claimed_payload');
