-- A retry of a FAILED child whose failure report its parent has not applied yet is refused.
--
-- A child that fails queues its report (CHILD_COMPLETION) at its parent in the commit that fails it; the
-- parent's worker applies it later. Until then the parent's position still waits for the child, so
-- child_standing (version 83) said 'awaited' and a retry of the child went through: the child ran its steps
-- again while the parent's worker applied the failure, which took the parent to the child step's on_failure
-- (or, in a saga, into compensation); the retried child's result then reached a parent that no longer awaited
-- it and was ignored (CALLBACK_IGNORED), its effects made twice for nothing
-- (tests/engine/test_child_retries.py, test_a_child_whose_failure_report_waits_at_its_parent_is_not_retried
-- printed "Failed: DID NOT RAISE InvalidState"). retry_instance now refuses such a child while its parent
-- still awaits it (outcome report_pending) and nothing changes; once the parent has applied the report the
-- retry is decided as before: refused when the parent moved on (not_awaited), retried when it failed at
-- that step (ChildFailed), which still awaits the child.
--
-- Concurrent with the parent's worker, the refusal is exact within the lock order: the retry locks the
-- child's row and only reads the parent's rows (a child never waits on its parent's rows). It reads the
-- report first and the parent's standing after, each statement in its own snapshot: a report seen queued
-- (PENDING, DEFERRED, or CLAIMED by the worker applying it) refuses; a report seen applied was committed with
-- the parent's move, which the standing read after it sees. The report is never missed for not existing yet:
-- the child's failing commit queued it and held the child's row, which the retry locked after it.

CREATE OR REPLACE FUNCTION {{schema}}.retry_instance(p_instance uuid, p_actor text)
RETURNS TABLE (outcome text, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_paths text[];
    v_waits text[];
    v_completions bigint[];
    v_task record;
    v_status text;
    v_timer bigint;
    v_plan jsonb;
    v_report boolean;
    v_standing text;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::text;
        RETURN;
    END IF;
    IF v_inst.status <> 'FAILED' THEN
        RETURN QUERY SELECT 'not_failed', v_inst.status;
        RETURN;
    END IF;
    -- A child whose parent no longer awaits it (child_standing, version 83) is refused, and nothing changes:
    -- its steps would run again for a result nothing takes, beside what the parent went on with. Its
    -- parent's rows are read, not locked (a child never waits on its parent's rows): a replay of the
    -- parent locks this row before it writes, so this reads the parent as that replay left it.
    -- A child whose failure report its parent has not applied yet (queued, or under the worker applying it) is
    -- refused while the parent still awaits it (outcome report_pending, version 89): applied, the report may
    -- take the parent past the child (on_failure, compensation). The report is read first, each read in its
    -- own snapshot: one seen applied is applied in the parent's standing read after it. The report exists:
    -- the child's commit that failed it queued it, and this row's lock waited for that commit.
    IF v_inst.parent_id IS NOT NULL THEN
        v_report := EXISTS (SELECT 1 FROM {{schema}}.commands x
                            WHERE x.instance_id = v_inst.parent_id AND x.kind = 'CHILD_COMPLETION'
                              AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                              AND x.payload->>'child_id' = p_instance::text);
        v_standing := {{schema}}.child_standing(v_inst);
        IF v_standing = 'not_awaited' THEN
            RETURN QUERY SELECT 'not_awaited', v_inst.status;
            RETURN;
        END IF;
        IF v_report AND v_standing = 'awaited' THEN
            RETURN QUERY SELECT 'report_pending', v_inst.status;
            RETURN;
        END IF;
    END IF;
    -- The instance deadline passed while it was FAILED and its timer has not fired: it fires here, as a
    -- worker's claim would have fired it (core/saga.py, _deadline).
    SELECT c.id INTO v_timer FROM {{schema}}.commands c
    WHERE c.instance_id = p_instance AND c.position = '$saga' AND c.kind = 'TIMER' AND c.name = 'deadline'
      AND ((c.state IN ('PENDING', 'DEFERRED')) IS TRUE AND c.available_at <= v_now
           OR (c.state = 'CLAIMED') IS TRUE)  -- claimed: it was due; a worker's late commit is refused
    ORDER BY c.id LIMIT 1 FOR UPDATE;
    IF FOUND THEN
        UPDATE {{schema}}.commands c SET state = 'COMPLETE', token = NULL, settled_at = v_now
        WHERE c.id = v_timer;
        PERFORM {{schema}}.saga_history(p_instance, 'DEADLINE_PASSED', NULL, NULL, '$saga', v_timer, p_actor,
                                        jsonb_build_object('cause', 'timed_out', 'status_before', 'FAILED',
                                                           'outcome', 'left FAILED for an operator'), v_now);
        SELECT i.history_seq INTO v_inst.history_seq FROM {{schema}}.instances i WHERE i.id = p_instance;
    END IF;
    -- A wait whose message's command was dead-lettered failed there with its wait kept (core/transitions.py,
    -- _dead_letter), its subscription used by that message. A RETRY entered the wait again and the dead command
    -- was superseded: the message, delivered to this instance, was never applied, and the wait opened anew for
    -- another (version 82). Such a wait waits again as it was (its subscription still used, so no other message
    -- is given to it) and its dead message is offered to it again below; every other failed position runs its
    -- failed step again (RETRY). So does a join whose branch's report was dead-lettered (its count kept; a
    -- RETRY forked again: every branch ran again, one waiting for a signal it had taken waited for it again),
    -- an external step whose task's completion was (a RETRY opened the task again: its work done twice) and a
    -- human task step whose task's completion or own timer was (a RETRY queued the task's timers a second
    -- time: the second reminder or escalation of the visit crashed on the first one's outbox event)
    -- (version 86).
    WITH failed AS (
        UPDATE {{schema}}.positions p SET
            status = CASE WHEN p.wait IS NOT NULL
                               AND EXISTS (SELECT 1 FROM {{schema}}.commands m
                                           WHERE m.instance_id = p.instance_id AND m.state = 'DEAD'
                                             AND (p.wait->>'kind', m.kind) IN (
                                                     ('signal', 'MESSAGE'), ('join', 'BRANCH_DONE'),
                                                     ('external', 'EXTERNAL_COMPLETION'),
                                                     ('task', 'TASK_COMPLETION'), ('task', 'TIMER'))
                                             AND m.position = p.path AND m.step = p.step AND m.visit = p.visit)
                          THEN 'WAITING' ELSE 'RUNNING' END,
            error = NULL, updated_at = v_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND x.status = 'FAILED'
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path, p.step, p.visit, p.status
    ), queued AS (
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, available_at,
                                         created_at)
        SELECT p_instance, failed.path, nextval('{{schema}}.command_seq'), 'RETRY', 'PENDING', failed.step,
               failed.visit, v_now, v_now
        FROM failed WHERE failed.status = 'RUNNING' ORDER BY failed.path
        RETURNING id
    )
    SELECT COALESCE(array_agg(failed.path), '{}'),
           COALESCE(array_agg(failed.path) FILTER (WHERE failed.status = 'WAITING'), '{}')
    INTO v_paths, v_waits FROM failed;  -- (queued runs unread)
    -- Each retried step's deadline, counted from now: the pending timers of those positions' steps are
    -- superseded (ascending id) and new ones queued. The positions just retried say which steps.
    UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
        last_error = 'RETRIED'
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   JOIN {{schema}}.positions r ON r.instance_id = p_instance AND r.path = ANY (v_paths)
                        AND r.path = x.payload->>'position' AND r.step = x.step
                   WHERE x.instance_id = p_instance AND x.position = '$saga' AND x.kind = 'TIMER'
                     AND x.name = 'step_deadline' AND (x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) IS TRUE
                   ORDER BY x.id FOR UPDATE OF x);
    -- The deadlines of the plan the instance runs (its plan hash), in the registration its pin was admitted
    -- against or in its own scope (registered there after it started): none known when it is not stored.
    SELECT d.plan INTO v_plan FROM {{schema}}.definitions d
    WHERE d.scope IN (v_inst.definition_scope, v_inst.scope) AND d.definition_id = v_inst.definition_id
      AND d.version = v_inst.version AND d.plan_hash = v_inst.plan_hash
    ORDER BY d.scope = v_inst.definition_scope DESC LIMIT 1;
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(v_plan->'steps') AS s WHERE s ? 'deadline') THEN
        PERFORM {{schema}}.open_saga_position(p_instance, v_now);
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, name, payload,
                                         available_at, created_at)
        SELECT p_instance, '$saga', nextval('{{schema}}.command_seq'), 'TIMER', 'PENDING', r.step, r.visit,
               'step_deadline', jsonb_build_object('position', r.path, 'step', r.step, 'visit', r.visit),
               v_now + make_interval(secs => (s->'deadline'->>'seconds')::float8), v_now
        FROM {{schema}}.positions r
        CROSS JOIN LATERAL jsonb_array_elements(v_plan->'steps') AS s
        WHERE r.instance_id = p_instance AND r.path = ANY (v_paths) AND s->>'name' = r.step AND s ? 'deadline'
        ORDER BY r.path;
    END IF;
    -- A dead message is offered again as a dead signal is (version 82; it was superseded, and lost): to the
    -- wait it was delivered to when that wait waits again (above), else applied as any message that finds its
    -- wait left (parked, or, taken from the buffer, handed on). A dead branch's report, a dead external
    -- task's completion and a dead timer are offered again to the step that waits again at their visit
    -- (version 86), and so are the reports of other branches parked at that join while it was failed
    -- (core/transitions.py, _branch_done): the join counts each once. Parked reports of a join that forks
    -- again (RETRY) are of the branches that run again, which report again: superseded. Any other dead
    -- command is superseded (a human task's completion among them: its task is given back below).
    WITH held AS (
        -- Every dead command, and the reports parked at a retried join; `offered`: PENDING again, else
        -- superseded (one pass, ascending id).
        SELECT x.id, x.kind IN ('SIGNAL', 'MESSAGE')
                     OR x.kind IN ('BRANCH_DONE', 'EXTERNAL_COMPLETION', 'TIMER') AND (r.path = ANY (v_waits)) IS TRUE
                     AS offered
        FROM {{schema}}.commands x
        LEFT JOIN {{schema}}.positions r ON r.instance_id = p_instance AND r.path = x.position
             AND r.step = x.step AND r.visit = x.visit
        WHERE x.instance_id = p_instance
          AND (x.state = 'DEAD' OR x.state = 'PARKED' AND x.kind = 'BRANCH_DONE' AND (r.path = ANY (v_paths)) IS TRUE)
        ORDER BY x.id FOR UPDATE OF x
    ), again AS (
        UPDATE {{schema}}.commands c SET state = 'PENDING', claims = 0, available_at = v_now, token = NULL
        WHERE c.id IN (SELECT held.id FROM held WHERE held.offered)
    ), gone AS (
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'RETRIED'
        WHERE c.id IN (SELECT held.id FROM held WHERE NOT held.offered)
        RETURNING c.id, c.kind
    )
    SELECT COALESCE(array_agg(gone.id) FILTER (WHERE gone.kind = 'TASK_COMPLETION'), '{}')
    INTO v_completions FROM gone;
    -- RUNNING while a position runs; when every open one waits (only waits that wait again: a task given back
    -- has nothing queued that would commit and say so), WAITING, as a commit would say (version 86).
    SELECT COALESCE(CASE WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END, 'RUNNING')
    INTO v_status FROM {{schema}}.positions p
    WHERE p.instance_id = p_instance AND p.status IN ('RUNNING', 'WAITING');
    UPDATE {{schema}}.instances i SET status = v_status, error = NULL,
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_RETRIED', v_inst.step, v_inst.visit, p_actor,
            jsonb_build_object('error', v_inst.error, 'positions', cardinality(v_paths)));
    -- A human task whose completion was dead-lettered is given back, as a refused completion gives it back:
    -- its task step waits again (above) with the task's own reminder, due date and expiry, which waited
    -- behind the completion. The RETRY that entered the step again gave it back too, but queued those
    -- timers a second time beside the first: the second reminder or escalation of the visit crashed its
    -- segment on the outbox event the first had written (version 86).
    FOR v_task IN SELECT k.id, k.position, k.step, k.visit, k.completion FROM {{schema}}.tasks k
                  WHERE k.instance_id = p_instance AND k.status = 'COMPLETING'
                    AND k.completion_command = ANY (v_completions)
                  ORDER BY k.id FOR UPDATE LOOP
        UPDATE {{schema}}.tasks k SET status = 'OPEN', completion = NULL, completion_command = NULL,
            updated_at = v_now
        WHERE k.id = v_task.id;
        PERFORM {{schema}}.append_history(p_instance, v_task.position, 'TASK_COMPLETION_REFUSED', v_task.step,
                                          v_task.visit, p_actor, jsonb_build_object(
                                              'task_id', v_task.id, 'decision', v_task.completion->>'decision',
                                              'actor', v_task.completion->>'actor', 'reason', 'DEAD_LETTERED'),
                                          v_now);
    END LOOP;
    RETURN QUERY SELECT 'retried', v_status;
END $$;
