-- Signal-with-start starts an instance as a start does: with the caller's durable context, the
-- instance deadline (an instant or seconds from now; the workflow's default when the caller gives
-- none) and the start step's deadline. start_or_signal (migration 0007) scheduled neither deadline,
-- so an instance started by a signal could never time out. It now calls this one.
CREATE FUNCTION {{schema}}.start_or_signal_with(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text, p_state jsonb,
    p_step text, p_business_key text, p_start_fingerprint text, p_actor text, p_signal text, p_payload jsonb,
    p_dedup_key text, p_signal_fingerprint text, p_context jsonb, p_deadline_at timestamptz,
    p_deadline_seconds float8, p_start_deadline_seconds float8)
RETURNS TABLE (outcome text, instance_id uuid, started boolean, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_target uuid;
    v_started boolean := false;
    r record;
BEGIN
    SELECT i.id INTO v_target FROM {{schema}}.instances i
    WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
    IF NOT FOUND THEN
        BEGIN
            PERFORM {{schema}}.schedule_start_deadlines(
                {{schema}}.start_with_context(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state, p_step,
                                              p_business_key, NULL, p_start_fingerprint, p_actor, p_context),
                p_deadline_at, p_deadline_seconds, p_step, p_start_deadline_seconds);
            v_target := p_id;
            v_started := true;
        EXCEPTION WHEN unique_violation THEN
            SELECT i.id INTO v_target FROM {{schema}}.instances i
            WHERE i.scope = p_scope AND i.definition_id = p_definition AND i.business_key = p_business_key;
        END;
    END IF;
    SELECT * INTO r FROM {{schema}}.signal_position(v_target, '', p_signal, p_payload, p_dedup_key,
                                                    p_signal_fingerprint, p_actor);
    RETURN QUERY SELECT r.outcome, v_target, v_started, r.command_id, r.status;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.start_or_signal(
    p_id uuid, p_scope text, p_definition text, p_version integer, p_plan_hash text, p_state jsonb,
    p_step text, p_business_key text, p_start_fingerprint text, p_actor text, p_signal text, p_payload jsonb,
    p_dedup_key text, p_signal_fingerprint text)
RETURNS TABLE (outcome text, instance_id uuid, started boolean, command_id bigint, status text)
LANGUAGE sql AS $$
    SELECT * FROM {{schema}}.start_or_signal_with(p_id, p_scope, p_definition, p_version, p_plan_hash, p_state,
                                                  p_step, p_business_key, p_start_fingerprint, p_actor, p_signal,
                                                  p_payload, p_dedup_key, p_signal_fingerprint, NULL, NULL, NULL, NULL)
$$;
