-- Human and external tasks (docs/tasks.md, docs/external-tasks.md).
--
-- An external task whose position was cancelled (the instance cancelled, a join's losers) ended only
-- when a fetch or an answer tripped over it: until then `stepstone external list --status open` and
-- GET /external-tasks listed it OPEN, and the worker holding it kept extending its lock on work nobody
-- waited for. Now the position's cancellation cancels it at once, as it cancels the position's human
-- tasks (status CANCELLED, last_error NOT_AWAITED, as the fetch and the answer close one); an answer or
-- a lock extension with its token is then refused as not_awaited. The lazy close stays for a position
-- that moves on another way (a repair, a migration).
--
-- A failure of an external task that is retried left no trace in the instance's history, only the
-- task row's last error: `stepstone history --failed` showed nothing of the attempts before the last.
-- Now each is an EXTERNAL_TASK_ATTEMPT_FAILED entry (the worker as a service actor; its message,
-- details, attempt, the retries left and when it is offered again).
--
-- A worker that lost the reply to a failure that was retried, and sent it again with the same token,
-- got lock_lost ("another worker has it"), where a repeated completion is told `duplicate`: the retry
-- had released the token. The released token is kept (released_token) and a failure sent again with
-- it is that answer again, `duplicate` (with the task's status now), counted once; any other answer
-- with it is still refused.
--
-- Retention's purge deleted an instance's positions, commands, history and dedup keys, but left its
-- human and external task rows (the state fields a task shows, the payloads of its completion and of
-- its worker's answers), the idempotency keys of its tasks' operations and its message subscriptions
-- for ever. Now a statement trigger on instances deletes them with it (instances_deleted).
-- Expand only: a nullable column, a new function and trigger; close_position_waits and
-- answer_external_task are replaced with the same signatures; their trigger is unchanged.
ALTER TABLE {{schema}}.external_tasks ADD COLUMN released_token uuid;

-- A cancelled position (the instance cancelled, a join's losers) cancels its open tasks, human and
-- external, and closes its subscriptions.
CREATE OR REPLACE FUNCTION {{schema}}.close_position_waits() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    UPDATE {{schema}}.tasks k SET status = 'CANCELLED', ended_at = v_now, updated_at = v_now
    WHERE k.instance_id = NEW.instance_id AND k.position = NEW.path AND k.status IN ('OPEN', 'COMPLETING');
    UPDATE {{schema}}.external_tasks x SET status = 'CANCELLED', last_error = 'NOT_AWAITED', updated_at = v_now,
        ended_at = v_now
    WHERE x.instance_id = NEW.instance_id AND x.position = NEW.path AND x.status = 'OPEN';
    UPDATE {{schema}}.subscriptions s SET status = 'CLOSED', closed_at = v_now
    WHERE s.instance_id = NEW.instance_id AND s.position = NEW.path AND s.status = 'OPEN';
    RETURN NULL;
END $$;

-- An answer that ends task p_task, fenced on p_token: p_outcome 'completed' (with p_variables),
-- 'error' (p_error: code, message, details) or 'failed' (p_error: message, details; p_retries and
-- p_retry_delay may override the task's own retry metadata: retried while retries remain).
-- outcome: 'recorded' (command_id: the EXTERNAL_COMPLETION on the position), 'retrying'
-- (available_at: when it is offered again; the attempt is in the history, migration 0049), 'duplicate' (this lock already answered so: the same
-- command), 'not_found', 'lock_lost' (the token does not hold the task: never locked by it, or the
-- lock moved to another worker), 'lock_expired', 'not_open' (the task already ended; status says
-- how) or 'not_awaited' (its position no longer waits for it; the task is cancelled).
CREATE OR REPLACE FUNCTION {{schema}}.answer_external_task(
    p_task uuid, p_token uuid, p_outcome text, p_variables jsonb, p_error jsonb, p_retries integer,
    p_retry_delay float8, p_worker text)
RETURNS TABLE (outcome text, command_id bigint, status text, available_at timestamptz, retries integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst uuid;
    t {{schema}}.external_tasks%ROWTYPE;
    v_left integer;
    v_delay float8;
    v_end text;
    v_id bigint;
BEGIN
    SELECT x.instance_id INTO v_inst FROM {{schema}}.external_tasks x WHERE x.id = p_task;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint, NULL::text, NULL::timestamptz, NULL::integer;
        RETURN;
    END IF;
    PERFORM 1 FROM {{schema}}.instances i WHERE i.id = v_inst FOR UPDATE;
    SELECT * INTO t FROM {{schema}}.external_tasks x WHERE x.id = p_task FOR UPDATE;
    -- A failure sent again with the token its retry released (a worker that lost the reply): that answer.
    IF p_outcome = 'failed' AND t.released_token = p_token THEN
        RETURN QUERY SELECT 'duplicate', NULL::bigint, t.status, NULL::timestamptz, NULL::integer;
        RETURN;
    END IF;
    IF t.lock_token IS DISTINCT FROM p_token THEN
        RETURN QUERY SELECT 'lock_lost', NULL::bigint, t.status, t.available_at, t.retries;
        RETURN;
    END IF;
    IF t.status <> 'OPEN' THEN
        RETURN QUERY SELECT CASE WHEN t.command_id IS NOT NULL
                                  AND t.status = CASE p_outcome WHEN 'completed' THEN 'COMPLETED'
                                                                WHEN 'error' THEN 'ERROR' ELSE 'FAILED' END
                                 THEN 'duplicate' ELSE 'not_open' END,
                            t.command_id, t.status, t.available_at, t.retries;
        RETURN;
    END IF;
    IF t.lock_until <= v_now THEN
        RETURN QUERY SELECT 'lock_expired', NULL::bigint, t.status, t.available_at, t.retries;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                   WHERE p.instance_id = t.instance_id AND p.path = t.position AND p.status = 'WAITING'
                     AND p.step = t.step AND p.visit = t.visit) THEN
        UPDATE {{schema}}.external_tasks x SET status = 'CANCELLED', last_error = 'NOT_AWAITED', updated_at = v_now,
            ended_at = v_now
        WHERE x.id = p_task;
        RETURN QUERY SELECT 'not_awaited', NULL::bigint, 'CANCELLED'::text, t.available_at, t.retries;
        RETURN;
    END IF;
    IF p_outcome = 'failed' THEN
        v_left := COALESCE(p_retries, t.retries - 1);
        IF v_left > 0 THEN
            v_delay := COALESCE(p_retry_delay, LEAST((t.backoff->>'max')::float8,
                (t.backoff->>'initial')::float8 * power((t.backoff->>'multiplier')::float8, t.attempts)));
            UPDATE {{schema}}.external_tasks x SET retries = v_left, attempts = x.attempts + 1,
                last_error = p_error->>'message', error_details = p_error->'details',
                available_at = v_now + make_interval(secs => GREATEST(v_delay, 0)),
                lock_token = NULL, released_token = p_token, lock_owner = NULL, lock_until = NULL,
                updated_at = v_now
            WHERE x.id = p_task
            RETURNING x.available_at INTO t.available_at;
            -- The attempt, in the instance's history (a failure without retries left is recorded by the
            -- worker that applies its EXTERNAL_COMPLETION: EXTERNAL_TASK_FAILED).
            PERFORM {{schema}}.append_history(
                t.instance_id, t.position, 'EXTERNAL_TASK_ATTEMPT_FAILED', t.step, t.visit,
                jsonb_build_object('kind', 'service', 'id', COALESCE(p_worker, t.lock_owner))::text,
                jsonb_build_object('task_id', t.id, 'worker', COALESCE(p_worker, t.lock_owner),
                                   'message', p_error->>'message', 'details', p_error->'details',
                                   'attempt', t.attempts + 1, 'retries', v_left, 'available_at', t.available_at),
                v_now);
            RETURN QUERY SELECT 'retrying', NULL::bigint, 'OPEN'::text, t.available_at, v_left;
            RETURN;
        END IF;
    END IF;
    v_end := CASE p_outcome WHEN 'completed' THEN 'COMPLETED' WHEN 'error' THEN 'ERROR' ELSE 'FAILED' END;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, step, visit, payload, available_at,
                                     created_at)
    VALUES (t.instance_id, t.position, nextval('{{schema}}.command_seq'), 'EXTERNAL_COMPLETION', 'PENDING', t.step,
            t.visit, jsonb_build_object('task_id', t.id, 'outcome', p_outcome, 'variables', p_variables,
                                        'error', p_error, 'worker', COALESCE(p_worker, t.lock_owner),
                                        'attempts', t.attempts + 1),
            v_now, v_now)
    RETURNING id INTO v_id;
    UPDATE {{schema}}.external_tasks x SET status = v_end, command_id = v_id, updated_at = v_now, ended_at = v_now,
        retries = CASE WHEN p_outcome = 'failed' THEN 0 ELSE x.retries END,
        attempts = x.attempts + CASE WHEN p_outcome = 'failed' THEN 1 ELSE 0 END,
        last_error = CASE WHEN p_outcome = 'completed' THEN x.last_error ELSE p_error->>'message' END,
        error_details = CASE WHEN p_outcome = 'completed' THEN x.error_details ELSE p_error->'details' END
    WHERE x.id = p_task;
    RETURN QUERY SELECT 'recorded', v_id, v_end, t.available_at, t.retries;
END $$;

-- An instance's task rows (human and external, with the data they show and the payloads of their
-- answers), the idempotency keys of its tasks' operations and its message subscriptions go with it when
-- it is deleted (retention's purge), as its positions, commands and history do.
CREATE FUNCTION {{schema}}.instances_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {{schema}}.dedup d USING {{schema}}.tasks k, gone g
    WHERE k.instance_id = g.id AND d.kind IN ('TASK_OP', 'TASK_COMPLETE') AND d.namespace = k.id::text;
    DELETE FROM {{schema}}.tasks k USING gone g WHERE k.instance_id = g.id;
    DELETE FROM {{schema}}.external_tasks x USING gone g WHERE x.instance_id = g.id;
    DELETE FROM {{schema}}.subscriptions s USING gone g WHERE s.instance_id = g.id;
    RETURN NULL;
END $$;

CREATE TRIGGER instances_deleted
    AFTER DELETE ON {{schema}}.instances REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.instances_deleted();
