-- A reassign or delegate of a task to the user who holds it already recorded TASK_REASSIGNED (or
-- TASK_DELEGATED) though nothing moved, where `reassign-all bob bob` is refused and claiming one's own
-- task changes nothing. task_assign now answers 'unchanged' for it, after the permission check (one who
-- may not hand the task on is still refused), and records nothing.
-- Expand only: task_assign replaced with the same signature.

CREATE OR REPLACE FUNCTION {{schema}}.task_assign(p_task uuid, p_op text, p_to text, p_actor text,
                                                  p_groups text[], p_force boolean, p_reason text,
                                                  p_key text, p_fingerprint text)
RETURNS TABLE (outcome text, task jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_task {{schema}}.tasks%ROWTYPE;
    v_seen text;
    v_assignee text;
    v_owner text;
    v_delegation text;
    v_kind text;
BEGIN
    v_task := {{schema}}.lock_task(p_task);
    IF v_task.id IS NULL THEN
        RETURN QUERY SELECT 'not_found', NULL::jsonb;
        RETURN;
    END IF;
    v_seen := {{schema}}.task_key_seen('TASK_OP', p_task, p_key, p_fingerprint);
    IF v_seen IS NOT NULL THEN
        RETURN QUERY SELECT v_seen, to_jsonb(v_task);
        RETURN;
    END IF;
    IF v_task.status <> 'OPEN' THEN
        RETURN QUERY SELECT 'not_open', to_jsonb(v_task);
        RETURN;
    END IF;
    v_assignee := v_task.assignee;
    v_owner := v_task.owner;
    v_delegation := v_task.delegation;
    IF p_op = 'claim' THEN
        IF v_task.assignee = p_actor THEN
            RETURN QUERY SELECT 'unchanged', to_jsonb(v_task);
            RETURN;
        END IF;
        IF v_task.assignee IS NOT NULL AND NOT p_force THEN
            RETURN QUERY SELECT 'held', to_jsonb(v_task);
            RETURN;
        END IF;
        IF NOT p_force AND NOT {{schema}}.task_allows(v_task, p_actor, p_groups) THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        v_assignee := p_actor;
        v_kind := 'TASK_CLAIMED';
    ELSIF p_op = 'unclaim' THEN
        IF v_task.assignee IS NULL THEN
            RETURN QUERY SELECT 'unchanged', to_jsonb(v_task);
            RETURN;
        END IF;
        IF v_task.assignee IS DISTINCT FROM p_actor AND NOT p_force THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        v_assignee := NULL;
        v_kind := 'TASK_UNCLAIMED';
    ELSIF p_op IN ('reassign', 'delegate') THEN
        IF NOT p_force AND p_actor IS DISTINCT FROM v_task.assignee AND p_actor IS DISTINCT FROM v_task.owner THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        -- To the user who holds it already: nothing moves, so nothing is recorded (as claiming one's
        -- own task); a retried reassign or delegate whose reply was lost gets the task as it is.
        IF p_to = v_task.assignee THEN
            RETURN QUERY SELECT 'unchanged', to_jsonb(v_task);
            RETURN;
        END IF;
        IF p_op = 'delegate' THEN
            v_owner := COALESCE(v_task.owner, v_task.assignee, p_actor);
            v_delegation := 'PENDING';
            v_kind := 'TASK_DELEGATED';
        ELSE
            v_kind := 'TASK_REASSIGNED';
        END IF;
        v_assignee := p_to;
    ELSIF p_op = 'resolve' THEN
        IF v_task.delegation IS DISTINCT FROM 'PENDING' THEN
            RETURN QUERY SELECT 'not_delegated', to_jsonb(v_task);
            RETURN;
        END IF;
        IF NOT p_force AND p_actor IS DISTINCT FROM v_task.assignee THEN
            RETURN QUERY SELECT 'not_permitted', to_jsonb(v_task);
            RETURN;
        END IF;
        v_assignee := v_task.owner;
        v_delegation := 'RESOLVED';
        v_kind := 'TASK_RESOLVED';
    ELSE
        RAISE EXCEPTION 'stepstone: unknown task operation %', p_op USING ERRCODE = 'P0001';
    END IF;
    UPDATE {{schema}}.tasks k SET assignee = v_assignee, owner = v_owner, delegation = v_delegation,
        updated_at = v_now
    WHERE k.id = p_task RETURNING * INTO v_task;
    IF p_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('TASK_OP', p_task::text, p_key, p_fingerprint, p_op, v_now);
    END IF;
    PERFORM {{schema}}.append_history(v_task.instance_id, v_task.position, v_kind, v_task.step, v_task.visit,
                                      p_actor, jsonb_strip_nulls(jsonb_build_object(
                                          'task_id', p_task, 'assignee', v_assignee, 'owner', v_owner,
                                          'forced', CASE WHEN p_force THEN true END, 'reason', NULLIF(p_reason, ''))),
                                      v_now);
    RETURN QUERY SELECT 'ok', to_jsonb(v_task);
END $$;
