-- External tasks: work an external step hands to outside workers, in any language.
--
-- A task row is written by the commit that enters the step (the 'external_tasks' feature section),
-- at the position's step visit; its id is derived from them, so an operator's retry of the failed
-- position re-opens the same row with fresh retries. Workers fetch and lock tasks by topic with
-- SKIP LOCKED; each lock has its own token and an expiry on the db clock, and every answer (extend,
-- complete, business error, failure) is fenced on that token and refused once the lock expired.
-- An answer that ends the task becomes an EXTERNAL_COMPLETION command on the position, in the same
-- transaction: a task is answered once.
--
-- status: OPEN (fetchable when available_at <= db_now(); while locked, available_at is the lock's
-- expiry, so an expired lock makes it fetchable again), COMPLETED, ERROR (a business error),
-- FAILED (no retries left: an incident on the instance) or CANCELLED (its position no longer waits
-- for it: closed when a fetch or an answer finds so). Lock order: instance row -> its task rows.
CREATE TABLE {{schema}}.external_tasks (
    id uuid PRIMARY KEY,
    instance_id uuid NOT NULL,
    position text NOT NULL,
    step text NOT NULL,
    visit integer NOT NULL,
    topic text NOT NULL,
    payload jsonb,
    status text NOT NULL,
    retries integer NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    backoff jsonb NOT NULL,
    available_at timestamptz NOT NULL,
    lock_token uuid,
    lock_owner text,
    lock_until timestamptz,
    locks integer NOT NULL DEFAULT 0,
    last_error text,
    error_details jsonb,
    command_id bigint,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    ended_at timestamptz
) WITH (fillfactor = 70);

CREATE INDEX external_tasks_open ON {{schema}}.external_tasks (topic, available_at, id) WHERE status = 'OPEN';
CREATE INDEX external_tasks_instance ON {{schema}}.external_tasks (instance_id);

-- Long polling: a task that becomes fetchable now notifies one channel per schema (payload: its topic).
CREATE FUNCTION {{schema}}.notify_external_task() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'OPEN' AND NEW.lock_token IS NULL AND NEW.available_at <= {{schema}}.db_now() THEN
        PERFORM pg_notify(left('stepstone_external_' || TG_TABLE_SCHEMA, 63), NEW.topic);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER external_tasks_notify
    AFTER INSERT OR UPDATE OF status, available_at, lock_token ON {{schema}}.external_tasks
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.notify_external_task();

-- The feature section: the tasks a commit opens (effect OpenExternalTask), at the committing position.
CREATE FUNCTION {{schema}}.open_external_tasks(p_commit jsonb, p_items jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.external_tasks AS t
        (id, instance_id, position, step, visit, topic, payload, status, retries, attempts, backoff,
         available_at, created_at, updated_at)
    SELECT (x->>'task_id')::uuid, (p_commit->>'instance')::uuid, p_commit->>'position', x->>'step',
           (x->>'visit')::integer, x->>'topic', x->'payload', 'OPEN', (x->>'retries')::integer, 0, x->'backoff',
           p_now, p_now, p_now
    FROM jsonb_array_elements(p_items) AS x
    ORDER BY (x->>'task_id')::uuid
    ON CONFLICT (id) DO UPDATE SET
        topic = EXCLUDED.topic, payload = EXCLUDED.payload, status = 'OPEN', retries = EXCLUDED.retries,
        attempts = 0, backoff = EXCLUDED.backoff, available_at = p_now, lock_token = NULL, lock_owner = NULL,
        lock_until = NULL, last_error = NULL, error_details = NULL, command_id = NULL, updated_at = p_now,
        ended_at = NULL;
END $$;

INSERT INTO {{schema}}.effect_sections VALUES ('external_tasks', 50, 'open_external_tasks');

-- An answer that ends task p_task, fenced on p_token: p_outcome 'completed' (with p_variables),
-- 'error' (p_error: code, message, details) or 'failed' (p_error: message, details; p_retries and
-- p_retry_delay may override the task's own retry metadata: retried while retries remain).
-- outcome: 'recorded' (command_id: the EXTERNAL_COMPLETION on the position), 'retrying'
-- (available_at: when it is offered again), 'duplicate' (this lock already answered so: the same
-- command), 'not_found', 'lock_lost' (the token does not hold the task: never locked by it, or the
-- lock moved to another worker), 'lock_expired', 'not_open' (the task already ended; status says
-- how) or 'not_awaited' (its position no longer waits for it; the task is cancelled).
CREATE FUNCTION {{schema}}.answer_external_task(
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
                lock_token = NULL, lock_owner = NULL, lock_until = NULL, updated_at = v_now
            WHERE x.id = p_task
            RETURNING x.available_at INTO t.available_at;
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

-- Outbox: an operator may discard a dead-lettered event (`stepstone outbox discard`) instead of
-- requeueing it. It leaves the unpublished set (published_at is set, so its key resumes and the
-- retention guard no longer holds its instance) and stays visible as discarded, never as published.
ALTER TABLE {{schema}}.outbox ADD COLUMN discarded_at timestamptz;
