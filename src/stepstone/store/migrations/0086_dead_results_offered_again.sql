-- A retry offers a dead-lettered branch's report and external task's completion again, to the step they were
-- made for, and gives a human task whose completion was dead-lettered back without entering its step again.
--
-- A command that crashed its workers until it was dead-lettered fails its position (its wait kept) and the
-- instance. retry_instance superseded every dead command but a signal or a message (version 82) and queued a
-- RETRY of the failed position's step. For two kinds of command that carry a result found nowhere else that
-- lost work:
-- * BRANCH_DONE, a branch's report to its join (at the fork's position): the RETRY entered the fork again,
--   which opened every branch again: the branches that had arrived ran their steps again, and one that had
--   taken a signal waited for it again, for ever unless it was sent again
--   (tests/engine/test_dead_results.py, test_a_dead_lettered_branch_report_is_counted_once_after_the_retry
--   printed "assert ('WAITING', {'quick': 2}) == ('COMPLETED', {'quick': 1})").
-- * EXTERNAL_COMPLETION, an external task's answer: the RETRY entered the external step again, which opened
--   its task again with fresh retries: the answer was lost and the task's work offered to a worker again
--   (test_a_dead_lettered_external_completion_is_applied_after_the_retry printed
--   "assert ('WAITING', 'OPEN') == ('COMPLETED', 'COMPLETED')").
-- Such a position waits again as it was (the join's count, the task's id), without a RETRY, and its dead
-- command is PENDING again: the join counts the report once, the step applies the answer once. Reports of
-- other branches that reached the join while it was failed are parked there (core/transitions.py) and are
-- PENDING again with it.
-- A human task's completion (TASK_COMPLETION) stays superseded and the task is given back (OPEN), as before,
-- but its task step now waits again too, without a RETRY: the RETRY entered the step again, which queued the
-- task's reminder, due date and expiry a second time beside the first, and the second reminder (or
-- escalation) of the visit crashed its segment on the outbox event id the first had written, until it was
-- dead-lettered and failed the instance again (test_a_dead_lettered_task_completion_gives_the_task_back_once
-- printed "assert 2 == 1", the reminders pending). The task is given back here, `TASK_COMPLETION_REFUSED`
-- (reason DEAD_LETTERED) in the history. A task step whose own timer (reminder, due date, expiry) was
-- dead-lettered waits again the same way, the timer PENDING again (the RETRY queued all three again beside
-- the two still pending: test_a_dead_lettered_task_timer_fires_once_after_the_retry printed "assert 2 == 1").
-- A dead timer of any wait that waits again is offered to it again. A child's report (CHILD_COMPLETION)
-- stays superseded: the RETRY of the child step starts no second child and queues the ended child's report
-- again (start_children).
-- Expand only: retry_instance replaced with the same signature.

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
    IF v_inst.parent_id IS NOT NULL AND {{schema}}.child_standing(v_inst) = 'not_awaited' THEN
        RETURN QUERY SELECT 'not_awaited', v_inst.status;
        RETURN;
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
