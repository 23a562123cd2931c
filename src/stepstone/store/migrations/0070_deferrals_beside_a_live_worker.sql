-- A command deferred for want of its plan is tried again soon while a worker that has the plan is up.
--
-- During a rolling deploy with workers of the old release (version 1 alone) beside workers of the new one
-- (version 2 alone), any worker of the definition claims any of its commands, and one that lacks the
-- instance's pinned version defers it (defer_command). The backoff was min(5 s * 2^deferrals, 5 min), cut
-- short only by the next heartbeat of a worker that has the pin (resume_deferred, every 10 s by default),
-- and the command could then be claimed by the wrong release again: with two workers of each release, 60
-- instances of a step, a wait and a step or two took 10.7-11.4 s from start to end at the median and up to
-- 21.5 s, against 2.6-2.7 s on four workers that carry both versions
-- (tests/chaos/test_rolling_deploy_kills.py without its kills). Now, while a worker that has the pin
-- heartbeated within the last 30 s (three heartbeats at the default `heartbeat_seconds`), the backoff is
-- min(0.25 s * 2^deferrals, 1 s): a worker of the right release can take the command at its next claim, and
-- each claim by a worker of the other release costs a quarter of a second, then half, then a second each.
-- When no such worker is up (stranded, or its workers just died), the long backoff stays, so workers
-- without the plan do not keep claiming and deferring it; a worker that died within 30 s of its last
-- heartbeat costs each of its commands at most about 30 short deferrals (one a second) before the long
-- backoff takes over. Measured after the change (three runs without kills): 1.6-3.1 s at the median, at
-- most 3.1-10.7 s (docs/versions.md). The look-up reads worker_plans_pin, and runs only when a command is
-- deferred, never on the claim or commit.
CREATE OR REPLACE FUNCTION {{schema}}.defer_command(p_instance uuid, p_path text, p_token uuid, p_reason text)
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
    IF EXISTS (SELECT 1 FROM {{schema}}.worker_plans w
               WHERE w.definition_id = v_inst.definition_id AND w.version = v_inst.version
                 AND w.plan_hash = v_inst.plan_hash AND w.seen_at > v_now - interval '30 seconds') THEN
        v_backoff := LEAST(1, 0.25 * power(2, v_cmd.deferrals));  -- a worker that has it is up
    ELSE
        v_backoff := LEAST(300, 5 * power(2, v_cmd.deferrals));
    END IF;
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
