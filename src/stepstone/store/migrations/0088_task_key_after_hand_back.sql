-- A human task's completion key whose completion was handed back is no duplicate: the same request under it
-- reserves the task again.
--
-- A completion reserves its task (OPEN -> COMPLETING) and records its key with the TASK_COMPLETION command
-- it made. When that completion is handed back (the segment refuses it and reopens the task; it is
-- dead-lettered and the instance's retry gives the task back, version 86; the retry of a failed position
-- enters the task's visit again and gives it back) the task is OPEN and decided by nobody, but the key still
-- answered its repeat as a duplicate with the task as it is now, and recorded nothing: the caller was told
-- its completion was made while the instance waited, and only a new key completed it
-- (tests/engine/test_task_key_hand_back.py, test_the_same_request_under_its_key_completes_a_task_given_back_by_a_retry
-- printed "assert (True, 'OPEN') == (False, 'COMPLETING')").
-- task_key_seen now answers a completion's key as a duplicate only while the task holds the command the key
-- recorded (its completion_command: COMPLETING under it, or COMPLETED by it); otherwise (handed back, and
-- perhaps completed by another since) the same request is no duplicate (NULL) and is taken as a new one:
-- it reserves an OPEN task again, the key then naming the new command, and a task another completion took
-- answers not_open with that completion. Another request under the key is still a conflict: a key names one
-- request. It is decided when the key is repeated, so every path that gives a task back is covered alike.
-- Expand only: task_key_seen and task_complete replaced with the same signatures.

CREATE OR REPLACE FUNCTION {{schema}}.task_key_seen(p_kind text, p_task uuid, p_key text, p_fingerprint text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN x.fingerprint <> p_fingerprint THEN 'conflict'
                WHEN x.kind = 'TASK_COMPLETE'
                     AND NOT EXISTS (SELECT 1 FROM {{schema}}.tasks k
                                     WHERE k.id = p_task AND k.completion_command::text = x.target) THEN NULL
                ELSE 'duplicate' END
    FROM {{schema}}.dedup x WHERE x.kind = p_kind AND x.namespace = p_task::text AND x.key = p_key
$$;

CREATE OR REPLACE FUNCTION {{schema}}.task_complete(p_task uuid, p_decision text, p_payload jsonb, p_actor text,
                                         p_groups text[], p_force boolean, p_key text, p_fingerprint text,
                                         p_reviewed bigint)
RETURNS TABLE (outcome text, task jsonb, changed text[])
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_task {{schema}}.tasks%ROWTYPE;
    v_seen text;
    v_state jsonb;
    v_changed text[];
    v_cmd bigint;
BEGIN
    v_task := {{schema}}.lock_task(p_task);
    IF v_task.id IS NULL THEN
        RETURN QUERY SELECT 'not_found', NULL::jsonb, NULL::text[];
        RETURN;
    END IF;
    v_seen := {{schema}}.task_key_seen('TASK_COMPLETE', p_task, p_key, p_fingerprint);
    IF v_seen IS NOT NULL THEN
        RETURN QUERY SELECT v_seen, to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF v_task.status <> 'OPEN' THEN
        RETURN QUERY SELECT 'not_open', to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF NOT p_decision = ANY (v_task.decisions) THEN
        RETURN QUERY SELECT 'unknown_decision', to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF NOT p_force AND NOT {{schema}}.task_allows(v_task, p_actor, p_groups) THEN
        RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task), NULL::text[];
        RETURN;
    END IF;
    IF v_task.require_version_stability THEN
        SELECT i.state INTO v_state FROM {{schema}}.instances i WHERE i.id = v_task.instance_id;
        v_changed := ARRAY(SELECT f.key FROM jsonb_each(v_task.data) AS f
                           WHERE {{schema}}.state_at(v_state, f.key) IS DISTINCT FROM f.value ORDER BY f.key);
        IF p_reviewed IS DISTINCT FROM v_task.state_version OR cardinality(v_changed) > 0 THEN
            RETURN QUERY SELECT 'stale', to_jsonb(v_task), v_changed;
            RETURN;
        END IF;
    END IF;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                     dedup_key, available_at, created_at)
    VALUES (v_task.instance_id, v_task.position, nextval('{{schema}}.command_seq'), 'TASK_COMPLETION', 'PENDING',
            v_task.step, v_task.visit, p_decision,
            jsonb_build_object('task_id', p_task, 'decision', p_decision, 'payload', p_payload, 'actor', p_actor),
            p_key, v_now, v_now)
    RETURNING id INTO v_cmd;
    UPDATE {{schema}}.tasks k SET status = 'COMPLETING', completion_command = v_cmd, updated_at = v_now,
        completion = jsonb_strip_nulls(jsonb_build_object('decision', p_decision, 'payload', p_payload,
                                                          'actor', p_actor, 'key', p_key, 'command', v_cmd,
                                                          'forced', CASE WHEN p_force THEN true END,
                                                          'at', v_now))
    WHERE k.id = p_task RETURNING * INTO v_task;
    -- A key whose completion was handed back (task_key_seen) now names this one (version 88).
    IF p_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('TASK_COMPLETE', p_task::text, p_key, p_fingerprint, v_cmd::text, v_now)
        ON CONFLICT (kind, namespace, key) DO UPDATE SET target = EXCLUDED.target, created_at = EXCLUDED.created_at;
    END IF;
    PERFORM {{schema}}.append_history(v_task.instance_id, v_task.position, 'TASK_COMPLETION_RECORDED', v_task.step,
                                      v_task.visit, p_actor, jsonb_strip_nulls(jsonb_build_object(
                                          'task_id', p_task, 'decision', p_decision, 'command', v_cmd,
                                          'forced', CASE WHEN p_force THEN true END)), v_now);
    RETURN QUERY SELECT 'reserved', to_jsonb(v_task), NULL::text[];
END $$;
