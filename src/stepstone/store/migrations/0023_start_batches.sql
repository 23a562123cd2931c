-- Batch starts: many instances of one workflow version in one statement (Client.start_many).
--
-- A start writes five rows and fires a trigger per row that checks the pin (instances_admit_pin),
-- redacts the baseline history (history_redact_baseline), applies flow limits (commands_flow_start,
-- at commit) and wakes the workers (commands_notify). For a batch all of that is the same for every
-- row, so start_batch does it once and tells those triggers to skip the rows it wrote, through the
-- transaction-local setting `stepstone.batch` (a list of words, reset before the function returns):
--   admitted   the pin was admitted once for the batch (definition_scope is set on every row)
--   notified   one notification for the batch instead of one per START command
--   plain      the plan has no sensitive paths: the baseline has nothing to redact
-- A word is set only when the batch did that work or there is none to do; otherwise the trigger runs
-- for each row as for a single start. Flow limits stay per row: a constraint trigger cannot be
-- replaced in place (CREATE OR REPLACE refuses it, and migrations do not DROP), so flow_on_start only
-- reads the clock after it found a limit. Measured on the local PostgreSQL 15 (10,000 starts in one
-- statement): the four triggers took 300 of 650 ms (docs/performance.md, "Batch starts").

-- The admission check of instances_admit_pin, callable once for a batch: the scope whose registration
-- the pin uses (the instance's own or 'default'), NULL when the workflow is registered nowhere (an
-- instance of an unregistered workflow is allowed, as before); raises as the trigger does otherwise.
CREATE FUNCTION {{schema}}.admitted_scope(p_definition text, p_version integer, p_plan_hash text, p_scope text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_row record;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1936028530, {{schema}}.define_lock_key(p_definition));
    SELECT d.scope, d.status, d.plan_hash INTO v_row
    FROM {{schema}}.definitions d
    WHERE d.definition_id = p_definition AND d.version = p_version AND d.scope IN (p_scope, 'default')
    ORDER BY (d.scope = p_scope) DESC
    LIMIT 1;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.definitions d WHERE d.definition_id = p_definition) THEN
            RAISE EXCEPTION USING ERRCODE = 'SSR01',
                MESSAGE = format('workflow %s v%s is not registered in scope %s or default',
                                 p_definition, p_version, p_scope);
        END IF;
        RETURN NULL;
    END IF;
    IF v_row.plan_hash <> p_plan_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'SSR02',
            MESSAGE = format('workflow %s v%s: the pin has plan %s but scope %s registered plan %s '
                             '(the structure changed without a version bump)',
                             p_definition, p_version, left(p_plan_hash, 12), v_row.scope, left(v_row.plan_hash, 12));
    END IF;
    IF v_row.status <> 'AVAILABLE' THEN
        RAISE EXCEPTION USING ERRCODE = 'SSR01',
            MESSAGE = format('workflow %s v%s is %s in scope %s; only an AVAILABLE version takes new instances',
                             p_definition, p_version, v_row.status, v_row.scope);
    END IF;
    RETURN v_row.scope;
END $$;

-- The trigger keeps its behaviour and now calls the one check.
CREATE OR REPLACE FUNCTION {{schema}}.admit_pin() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.definition_id = OLD.definition_id AND NEW.version = OLD.version
       AND NEW.plan_hash = OLD.plan_hash AND NEW.scope = OLD.scope THEN
        RETURN NEW;
    END IF;
    NEW.definition_scope := COALESCE({{schema}}.admitted_scope(NEW.definition_id, NEW.version, NEW.plan_hash,
                                                               NEW.scope), NEW.definition_scope);
    RETURN NEW;
END $$;

-- Each trigger below reads the setting inline: a trigger's WHEN is not planned, so a SQL function there
-- would be run through the function manager for every row (no inlining), which costs more than the
-- comparison. The words share no substrings, so strpos finds exactly the word asked for.
CREATE OR REPLACE TRIGGER instances_admit_pin
    BEFORE INSERT OR UPDATE OF definition_id, version, plan_hash, scope ON {{schema}}.instances
    FOR EACH ROW WHEN (strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'admitted') = 0) EXECUTE FUNCTION {{schema}}.admit_pin();

CREATE OR REPLACE TRIGGER history_redact_baseline
    BEFORE INSERT ON {{schema}}.history
    FOR EACH ROW WHEN (NEW.kind = 'INSTANCE_STARTED' AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'plain') = 0)
    EXECUTE FUNCTION {{schema}}.redact_baseline();

CREATE OR REPLACE TRIGGER commands_notify
    AFTER INSERT OR UPDATE OF state, available_at ON {{schema}}.commands
    FOR EACH ROW WHEN (NEW.state IN ('PENDING', 'DEFERRED') AND strpos(COALESCE(current_setting('stepstone.batch', true), ''), 'notified') = 0)
    EXECUTE FUNCTION {{schema}}.notify_command();

-- Start many instances of one pinned version in one statement. Per item (arrays of one length): the
-- new id, the state, the business key, the idempotency key and its fingerprint; for all: the scope,
-- the start step, the actor, the caller's durable context and the deadlines (as start_with_context and
-- schedule_start_deadlines take them). The batch is one transaction: every item starts or none does.
-- A business key in use fails the statement (unique_violation), and so does an idempotency key used
-- before with other input (SSK01, DETAIL the instance it started), by an earlier call or by an earlier
-- item of this batch. Returns one row per item, in input order (idx from 1): the instance id (the
-- earlier one for a key used before with the same input) and whether this call created it.
CREATE FUNCTION {{schema}}.start_batch(
    p_ids uuid[], p_scope text, p_definition text, p_version integer, p_plan_hash text, p_states jsonb[],
    p_step text, p_business_keys text[], p_keys text[], p_fingerprints text[], p_actor text, p_context jsonb,
    p_deadline_at timestamptz, p_deadline_seconds float8, p_start_deadline_seconds float8)
RETURNS TABLE (idx integer, instance_id uuid, created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_scope text;
    v_paths jsonb;
    v_words text[] := ARRAY['admitted', 'notified'];
    v_created uuid[];
    v_clash record;
BEGIN
    PERFORM set_config('stepstone.actor', COALESCE(p_actor, ''), true);
    v_scope := {{schema}}.admitted_scope(p_definition, p_version, p_plan_hash, p_scope);
    -- The same lookup as redact_baseline's: nothing to redact, nothing the trigger would change.
    SELECT d.plan -> 'sensitive' INTO v_paths FROM {{schema}}.definitions d
    WHERE d.scope = COALESCE(v_scope, p_scope) AND d.definition_id = p_definition AND d.version = p_version;
    IF v_paths IS NULL OR jsonb_typeof(v_paths) <> 'array' OR jsonb_array_length(v_paths) = 0 THEN
        v_words := v_words || 'plain'::text;
    END IF;
    PERFORM set_config('stepstone.batch', array_to_string(v_words, ','), true);

    WITH input AS MATERIALIZED (
        SELECT t.id, t.state, t.business_key, t.key, t.fingerprint
        FROM unnest(p_ids, p_states, p_business_keys, p_keys, p_fingerprints)
             AS t(id, state, business_key, key, fingerprint)
    ), keyed AS (
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        SELECT 'START', p_scope || '/' || p_definition, input.key, input.fingerprint, input.id::text, v_now
        FROM input WHERE input.key IS NOT NULL
        ON CONFLICT DO NOTHING
        RETURNING target
    ), go AS MATERIALIZED (
        SELECT input.* FROM input WHERE input.key IS NULL OR input.id::text IN (SELECT target FROM keyed)
    ), inst AS (
        INSERT INTO {{schema}}.instances (id, scope, definition_id, version, plan_hash, definition_scope, status,
                                          state, step, visit, business_key, next_seq, history_seq, context,
                                          created_at, updated_at)
        SELECT go.id, p_scope, p_definition, p_version, p_plan_hash, v_scope, 'PENDING', go.state, p_step, 1,
               go.business_key, 2, 1, p_context, v_now, v_now FROM go
        RETURNING id
    ), pos AS (
        INSERT INTO {{schema}}.positions (instance_id, path, status, step, visit, created_at, updated_at)
        SELECT go.id, '', 'RUNNING', p_step, 1, v_now, v_now FROM go
    ), cmd AS (
        INSERT INTO {{schema}}.commands (instance_id, seq, kind, state, step, visit, dedup_key, available_at,
                                         created_at)
        SELECT go.id, 1, 'START', 'PENDING', p_step, 1, go.key, v_now, v_now FROM go
    ), hist AS (
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, actor, data)
        SELECT go.id, 1, v_now, 'INSTANCE_STARTED', p_step, 1, p_actor,
               jsonb_build_object('state', go.state, 'version', p_version, 'plan_hash', p_plan_hash) FROM go
    )
    SELECT array_agg(inst.id) FROM inst INTO v_created;
    PERFORM set_config('stepstone.batch', '', true);

    IF p_deadline_at IS NOT NULL OR p_deadline_seconds IS NOT NULL OR p_start_deadline_seconds IS NOT NULL THEN
        PERFORM {{schema}}.schedule_start_deadlines(c.id, p_deadline_at, p_deadline_seconds, p_step,
                                                    p_start_deadline_seconds)
        FROM unnest(v_created) AS c(id);
    END IF;
    IF v_created IS NOT NULL THEN
        PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                           WHERE c.oid = '{{schema}}.commands'::regclass),
                          (extract(epoch FROM v_now) * 1000)::bigint::text);
    END IF;

    -- A statement of its own, so it sees the keys this batch wrote too.
    SELECT t.key, d.target INTO v_clash
    FROM unnest(p_ids, p_keys, p_fingerprints) AS t(id, key, fingerprint)
    JOIN {{schema}}.dedup d ON d.kind = 'START' AND d.namespace = p_scope || '/' || p_definition AND d.key = t.key
    WHERE d.target <> t.id::text AND d.fingerprint <> t.fingerprint
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'SSK01', DETAIL = v_clash.target,
            MESSAGE = format('idempotency key %L already started instance %s with different input',
                             v_clash.key, v_clash.target);
    END IF;

    RETURN QUERY
    SELECT t.n::integer, COALESCE(c.id, d.target::uuid, t.id), c.id IS NOT NULL
    FROM unnest(p_ids, p_keys) WITH ORDINALITY AS t(id, key, n)
    LEFT JOIN unnest(v_created) AS c(id) ON c.id = t.id
    LEFT JOIN {{schema}}.dedup d
           ON c.id IS NULL AND d.kind = 'START' AND d.namespace = p_scope || '/' || p_definition AND d.key = t.key
    ORDER BY t.n;
END $$;


-- flow_on_start read the clock before it knew there was a limit: now only when there is one (a start of a
-- workflow without a flow limit, the common case, runs two index lookups and returns).
CREATE OR REPLACE FUNCTION {{schema}}.flow_on_start() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_inst record;
    v_lim {{schema}}.flow_limits%ROWTYPE;
    v_key text;
    v_now timestamptz;
BEGIN
    SELECT i.scope, i.definition_id, i.business_key, i.state INTO v_inst
    FROM {{schema}}.instances i WHERE i.id = NEW.instance_id;
    SELECT * INTO v_lim FROM {{schema}}.flow_limits l
    WHERE l.scope = v_inst.scope AND l.definition_id = v_inst.definition_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_now := {{schema}}.db_now();
    v_key := CASE WHEN v_lim.key_field IS NULL THEN ''
                  WHEN v_lim.key_field = 'business_key' THEN COALESCE(v_inst.business_key, '')
                  ELSE COALESCE(v_inst.state->>v_lim.key_field, '') END;
    INSERT INTO {{schema}}.flow_slots (scope, definition_id, key_value) VALUES (v_inst.scope, v_inst.definition_id, v_key)
    ON CONFLICT DO NOTHING;
    PERFORM 1 FROM {{schema}}.flow_slots s
    WHERE s.scope = v_inst.scope AND s.definition_id = v_inst.definition_id AND s.key_value = v_key FOR UPDATE;
    UPDATE {{schema}}.instances i SET flow_key = v_key WHERE i.id = NEW.instance_id;
    UPDATE {{schema}}.commands c SET state = 'DEFERRED', available_at = {{schema}}.flow_held_until(),
        last_error = 'FLOW_HELD: waiting for a slot of the concurrency or rate limit'
    WHERE c.id = NEW.id AND c.state = 'PENDING';
    IF FOUND THEN
        INSERT INTO {{schema}}.flow_queue (instance_id, scope, definition_id, key_value, queued_at)
        VALUES (NEW.instance_id, v_inst.scope, v_inst.definition_id, v_key, v_now);
        PERFORM {{schema}}.flow_admit_queued(v_inst.scope, v_inst.definition_id, v_key, v_now);
    END IF;
    RETURN NULL;
END $$;

-- The baseline's redaction read the sensitive paths of the registration in the instance's own scope,
-- but an instance in a scope with no registration of its own runs the default scope's
-- (definition_scope, set by the pin admission): it found no paths, and a sensitive input value was
-- kept in the INSTANCE_STARTED entry. It now reads the registration the pin was admitted against.
CREATE OR REPLACE FUNCTION {{schema}}.redact_baseline() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_paths jsonb;
    v_path jsonb;
    v_state jsonb;
BEGIN
    SELECT d.plan -> 'sensitive' INTO v_paths
    FROM {{schema}}.instances i
    JOIN {{schema}}.definitions d ON d.scope = COALESCE(i.definition_scope, i.scope)
                                  AND d.definition_id = i.definition_id AND d.version = i.version
    WHERE i.id = NEW.instance_id;
    IF v_paths IS NULL OR jsonb_typeof(v_paths) <> 'array' OR NEW.data IS NULL OR NOT NEW.data ? 'state' THEN
        RETURN NEW;
    END IF;
    v_state := NEW.data -> 'state';
    FOR v_path IN SELECT jsonb_array_elements(v_paths) LOOP
        v_state := {{schema}}.redact_path(v_state, ARRAY(SELECT jsonb_array_elements_text(v_path)));
    END LOOP;
    NEW.data := jsonb_set(NEW.data, '{state}', v_state);
    RETURN NEW;
END $$;
