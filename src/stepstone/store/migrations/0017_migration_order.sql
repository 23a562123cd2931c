-- In-flight migration in the instance's command order, and deferrals an operator can see.
--
-- Expand only: two new functions; migrate_instance (0008) stays for callers of the previous release.
--
-- migrate_in_order(p_order_seq, ...) is migrate_instance with the migration's place in the order:
-- the caller reserves a command seq when it first plans the migration, and the migration applies
-- only once every command queued before that seq which can run now has run ('queued' until then),
-- so a signal sent before the migration is applied on the version it was sent to, and the MIGRATION
-- command is recorded at the reserved seq. A command that cannot run does not hold the migration
-- back, since the migration is how such an instance moves: one deferred because the workers that
-- claimed it lack the plan (NOT_RUNNABLE), and any command of an instance whose pinned plan no worker
-- served within the last p_served_within seconds (worker_plans, the stranded report's rule).
CREATE FUNCTION {{schema}}.migrate_in_order(
    p_order_seq bigint, p_instance uuid, p_from_version integer, p_from_hash text, p_state_version bigint,
    p_to_version integer, p_to_hash text, p_step_map jsonb, p_positions jsonb, p_state jsonb, p_actor text,
    p_served_within double precision)
RETURNS TABLE (outcome text, command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_inst {{schema}}.instances%ROWTYPE;
    v_outcome text;
    v_id bigint;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;  -- first in the lock order
    IF EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
               WHERE w.definition_id = v_inst.definition_id AND w.version = v_inst.version
                 AND w.plan_hash = v_inst.plan_hash
                 AND w.seen_at > {{schema}}.db_now() - make_interval(secs => p_served_within))
       AND EXISTS (SELECT 1 FROM {{schema}}.commands c
               WHERE c.instance_id = p_instance AND c.seq < p_order_seq
                 AND c.state IN ('PENDING', 'DEFERRED') AND c.available_at <= {{schema}}.db_now()
                 AND NOT (c.state = 'DEFERRED' AND c.last_error LIKE 'NOT\_RUNNABLE%')) THEN
        RETURN QUERY SELECT 'queued', NULL::bigint;
        RETURN;
    END IF;
    SELECT m.outcome, m.command_id INTO v_outcome, v_id
    FROM {{schema}}.migrate_instance(p_instance, p_from_version, p_from_hash, p_state_version, p_to_version,
                                     p_to_hash, p_step_map, p_positions, p_state, p_actor) m;
    IF v_id IS NOT NULL THEN
        UPDATE {{schema}}.commands c SET seq = p_order_seq WHERE c.id = v_id;
    END IF;
    RETURN QUERY SELECT v_outcome, v_id;
END $$;

-- A worker that lacks the pinned plan hands the command back (backoff min(5 s * 2^deferrals, 5 min),
-- the claim it spent restored) and says so in the instance's history: COMMAND_DEFERRED names the
-- command, the pin no live worker served, the backoff and when it is tried again, so an operator can
-- see why the instance does not move. Locks: instance row -> position -> command -> history.
CREATE FUNCTION {{schema}}.defer_command(p_instance uuid, p_path text, p_token uuid, p_reason text)
RETURNS TABLE (command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_cmd {{schema}}.commands%ROWTYPE;
    v_backoff double precision;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
    WHERE p.instance_id = p_instance AND p.path = p_path AND p.lease_token = p_token;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO v_cmd FROM {{schema}}.commands c
    WHERE c.instance_id = p_instance AND c.position = p_path AND c.token = p_token AND c.state = 'CLAIMED'
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_backoff := LEAST(300, 5 * power(2, v_cmd.deferrals));
    UPDATE {{schema}}.commands c SET state = 'DEFERRED', token = NULL, claims = GREATEST(c.claims - 1, 0),
        deferrals = c.deferrals + 1, last_error = p_reason, available_at = v_now + make_interval(secs => v_backoff)
    WHERE c.id = v_cmd.id;
    PERFORM {{schema}}.append_history(
        p_instance, p_path, 'COMMAND_DEFERRED', v_cmd.step, v_cmd.visit, NULL,
        jsonb_build_object('command', v_cmd.id, 'kind', v_cmd.kind, 'reason', p_reason,
                           'deferrals', v_cmd.deferrals + 1, 'backoff_seconds', v_backoff,
                           'retry_at', v_now + make_interval(secs => v_backoff),
                           'pin', jsonb_build_object('scope', v_inst.definition_scope,
                                                     'definition_id', v_inst.definition_id,
                                                     'version', v_inst.version, 'plan_hash', v_inst.plan_hash)),
        v_now);
    RETURN QUERY SELECT v_cmd.id;
END $$;
