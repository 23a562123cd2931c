-- The definitions registry: versions and their lifecycle, scopes and activations, pin admission,
-- what each live worker serves (for the stranded-instance report) and in-flight migration.
--
-- A definition row is (scope, definition_id, version): kind CODE (recorded by workers at start-up)
-- or DOCUMENT (YAML/JSON text with its SHA-256 digest), status
--     CANDIDATE -> PUBLISHING -> AVAILABLE <-> DEPRECATED -> RETIRED (-> AVAILABLE: reinstatement)
-- Every lifecycle change takes the definition id's advisory lock (define_lock below) exclusively;
-- pin admission takes it shared, so starts never serialize each other but a deprecation waits for
-- the starts already admitting.
-- Lock order (adds to the one in the version 2 section): a lifecycle change takes the definition id's
-- advisory lock, then the id's definition rows, then activations, and never an instance row. Pin
-- admission takes the advisory lock shared from inside a statement that may already hold instance rows
-- (a migration: instance -> positions -> commands -> history); no lifecycle transaction waits for an
-- instance row, so the two cannot deadlock.
ALTER TABLE {{schema}}.definitions
    ADD COLUMN kind text NOT NULL DEFAULT 'CODE',
    ADD COLUMN status text NOT NULL DEFAULT 'AVAILABLE',
    ADD COLUMN state_model text,
    ADD COLUMN signal_names jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN message_names jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN input_schema jsonb,
    ADD COLUMN document text,
    ADD COLUMN document_format text,
    ADD COLUMN document_digest text,
    ADD COLUMN publish_token uuid,
    ADD COLUMN publish_claimed_at timestamptz,
    ADD COLUMN status_changed_at timestamptz,
    ADD CONSTRAINT definitions_kind CHECK (kind IN ('CODE', 'DOCUMENT')),
    ADD CONSTRAINT definitions_status
        CHECK (status IN ('CANDIDATE', 'PUBLISHING', 'AVAILABLE', 'DEPRECATED', 'RETIRED')),
    ADD CONSTRAINT definitions_document
        CHECK ((kind = 'DOCUMENT') = (document IS NOT NULL) AND (document IS NULL) = (document_digest IS NULL)),
    ADD CONSTRAINT definitions_publishing CHECK ((status = 'PUBLISHING') = (publish_token IS NOT NULL));

-- Each scope's current version of a definition id. No row: the scope follows the default scope.
CREATE TABLE {{schema}}.definition_activations (
    scope text NOT NULL,
    definition_id text NOT NULL,
    target_scope text NOT NULL,
    version integer NOT NULL,
    activated_at timestamptz NOT NULL,
    activated_by text,
    PRIMARY KEY (scope, definition_id),
    CONSTRAINT activations_target CHECK (target_scope = scope OR target_scope = 'default'),
    CONSTRAINT activations_definition FOREIGN KEY (target_scope, definition_id, version)
        REFERENCES {{schema}}.definitions (scope, definition_id, version) ON DELETE RESTRICT
);

-- What each worker serves, refreshed by its heartbeat: the stranded report joins instances to it.
CREATE TABLE {{schema}}.worker_plans (
    worker_id text NOT NULL,
    scope text NOT NULL,
    definition_id text NOT NULL,
    version integer NOT NULL,
    plan_hash text NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    PRIMARY KEY (worker_id, definition_id, version, scope)
);
CREATE INDEX worker_plans_pin ON {{schema}}.worker_plans (definition_id, version, plan_hash, seen_at);

-- The instance's scope column is its scope key (tenant); definition_scope is the scope of the
-- definition row it is pinned to (its own scope's row of that version when there is one, else the
-- default scope's), set by pin admission.
ALTER TABLE {{schema}}.instances ADD COLUMN definition_scope text NOT NULL DEFAULT 'default';
CREATE INDEX instances_scope_newest ON {{schema}}.instances (scope, created_at DESC, id DESC);

-- The one advisory lock of a definition id (two int4 keys: a namespace and the id's hash).
CREATE FUNCTION {{schema}}.define_lock_key(p_definition text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext('stepstone.definition:' || p_definition) $$;

-- Pin admission: before an instance row gets a pin (a start, a child, a migration's re-pin), the pinned
-- version must be AVAILABLE with the same plan hash. An id the registry has never seen is admitted
-- (an engine used without registration). Refusals raise SQLSTATE SSR01 (not admitted) or SSR02 (drift)
-- with a one-line message; the store maps them to VersionNotAdmitted and DefinitionDrift.
CREATE FUNCTION {{schema}}.admit_pin() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_row record;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.definition_id = OLD.definition_id AND NEW.version = OLD.version
       AND NEW.plan_hash = OLD.plan_hash AND NEW.scope = OLD.scope THEN
        RETURN NEW;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1936028530, {{schema}}.define_lock_key(NEW.definition_id));
    SELECT d.scope, d.status, d.plan_hash INTO v_row
    FROM {{schema}}.definitions d
    WHERE d.definition_id = NEW.definition_id AND d.version = NEW.version AND d.scope IN (NEW.scope, 'default')
    ORDER BY (d.scope = NEW.scope) DESC
    LIMIT 1;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.definitions d WHERE d.definition_id = NEW.definition_id) THEN
            RAISE EXCEPTION USING ERRCODE = 'SSR01',
                MESSAGE = format('workflow %s v%s is not registered in scope %s or default',
                                 NEW.definition_id, NEW.version, NEW.scope);
        END IF;
        RETURN NEW;
    END IF;
    IF v_row.plan_hash <> NEW.plan_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'SSR02',
            MESSAGE = format('workflow %s v%s: the pin has plan %s but scope %s registered plan %s '
                             '(the structure changed without a version bump)',
                             NEW.definition_id, NEW.version, left(NEW.plan_hash, 12), v_row.scope,
                             left(v_row.plan_hash, 12));
    END IF;
    IF v_row.status <> 'AVAILABLE' THEN
        RAISE EXCEPTION USING ERRCODE = 'SSR01',
            MESSAGE = format('workflow %s v%s is %s in scope %s; only an AVAILABLE version takes new instances',
                             NEW.definition_id, NEW.version, v_row.status, v_row.scope);
    END IF;
    NEW.definition_scope := v_row.scope;
    RETURN NEW;
END $$;

CREATE TRIGGER instances_admit_pin
    BEFORE INSERT OR UPDATE OF definition_id, version, plan_hash, scope ON {{schema}}.instances
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.admit_pin();

-- Signals are checked against the definition the instance is pinned to (its definition scope).
CREATE OR REPLACE FUNCTION {{schema}}.signal_position(
    p_instance uuid, p_position text, p_name text, p_payload jsonb, p_dedup_key text, p_fingerprint text,
    p_actor text)
RETURNS TABLE (outcome text, command_id bigint, status text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_id bigint;
    v_prior record;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint, NULL::text;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {{schema}}.definitions d
                   WHERE d.scope IN (v_inst.scope, v_inst.definition_scope)
                     AND d.definition_id = v_inst.definition_id
                     AND d.version = v_inst.version AND d.plan->'signals' ? p_name) THEN
        RETURN QUERY SELECT 'unknown_signal', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    IF p_position <> '' AND NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                                        WHERE p.instance_id = p_instance AND p.path = p_position) THEN
        RETURN QUERY SELECT 'no_position', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    IF p_dedup_key IS NOT NULL THEN
        SELECT x.fingerprint, x.target INTO v_prior FROM {{schema}}.dedup x
        WHERE x.kind = 'SIGNAL' AND x.namespace = p_instance::text AND x.key = p_dedup_key;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN v_prior.fingerprint = p_fingerprint THEN 'duplicate' ELSE 'conflict' END,
                                v_prior.target::bigint, v_inst.status;
            RETURN;
        END IF;
    END IF;
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
        RETURN QUERY SELECT 'ended', NULL::bigint, v_inst.status;
        RETURN;
    END IF;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, name, payload, dedup_key,
                                     available_at, created_at)
    VALUES (p_instance, p_position, nextval('{{schema}}.command_seq'), 'SIGNAL', 'PENDING', p_name, p_payload,
            p_dedup_key, v_now, v_now)
    RETURNING id INTO v_id;
    IF p_dedup_key IS NOT NULL THEN
        INSERT INTO {{schema}}.dedup (kind, namespace, key, fingerprint, target, created_at)
        VALUES ('SIGNAL', p_instance::text, p_dedup_key, p_fingerprint, v_id::text, v_now);
    END IF;
    RETURN QUERY SELECT 'recorded', v_id, v_inst.status;
END $$;

-- In-flight migration of one instance to another version of its definition, between segments:
-- refused ('busy') while any position of it is leased or any command CLAIMED, ('changed') when its
-- state or pin moved since the caller read them (the caller reads again and re-plans). Otherwise, in
-- one transaction: positions and their open commands move to their mapped steps, the pin and state
-- change (pin admission checks the target), a settled MIGRATION command is recorded in the instance's
-- command order and the history gets an INSTANCE_MIGRATED entry with the full state baseline.
-- p_step_map maps step names of open commands to their targets; p_positions holds every position as
-- the caller read it (path, step, visit, status) with where it goes (to_step, to_wait; a JSON null
-- to_wait keeps the wait as it is): any difference from the rows is 'changed'.
CREATE FUNCTION {{schema}}.migrate_instance(
    p_instance uuid, p_from_version integer, p_from_hash text, p_state_version bigint,
    p_to_version integer, p_to_hash text, p_step_map jsonb, p_positions jsonb, p_state jsonb, p_actor text)
RETURNS TABLE (outcome text, command_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_inst {{schema}}.instances%ROWTYPE;
    v_id bigint;
BEGIN
    SELECT * INTO v_inst FROM {{schema}}.instances i WHERE i.id = p_instance FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.version = p_to_version AND v_inst.plan_hash = p_to_hash THEN
        RETURN QUERY SELECT 'already', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.version <> p_from_version OR v_inst.plan_hash <> p_from_hash
       OR v_inst.state_version <> p_state_version THEN
        RETURN QUERY SELECT 'changed', NULL::bigint;
        RETURN;
    END IF;
    IF v_inst.status IN ('COMPLETED', 'CANCELLED') THEN
        RETURN QUERY SELECT 'ended', NULL::bigint;
        RETURN;
    END IF;
    PERFORM 1 FROM {{schema}}.positions p WHERE p.instance_id = p_instance ORDER BY p.path FOR UPDATE;
    IF (SELECT count(*) FROM {{schema}}.positions p WHERE p.instance_id = p_instance)
           <> jsonb_array_length(p_positions)
       OR EXISTS (SELECT 1 FROM jsonb_array_elements(p_positions) e
                  LEFT JOIN {{schema}}.positions p ON p.instance_id = p_instance AND p.path = e->>'path'
                  WHERE p.path IS NULL OR p.step IS DISTINCT FROM e->>'step' OR p.visit <> (e->>'visit')::integer
                     OR p.status <> e->>'status') THEN
        RETURN QUERY SELECT 'changed', NULL::bigint;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM {{schema}}.positions p
               WHERE p.instance_id = p_instance AND p.lease_until IS NOT NULL AND p.lease_until > v_now)
       OR EXISTS (SELECT 1 FROM {{schema}}.commands c
                  WHERE c.instance_id = p_instance AND c.state = 'CLAIMED' AND c.available_at > v_now) THEN
        RETURN QUERY SELECT 'busy', NULL::bigint;
        RETURN;
    END IF;
    UPDATE {{schema}}.positions p SET
        step = e->>'to_step',
        wait = CASE WHEN e->'to_wait' = 'null'::jsonb THEN p.wait ELSE e->'to_wait' END,
        updated_at = v_now
    FROM jsonb_array_elements(p_positions) e
    WHERE p.instance_id = p_instance AND p.path = e->>'path' AND e ? 'to_step';
    UPDATE {{schema}}.commands c SET step = p_step_map->>c.step
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                     AND x.step IS NOT NULL AND p_step_map ? x.step
                   ORDER BY x.id FOR UPDATE);
    UPDATE {{schema}}.instances i SET
        version = p_to_version, plan_hash = p_to_hash, state = p_state,
        state_version = i.state_version + 1,
        step = COALESCE((SELECT p.step FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
                        i.step),
        wait = (SELECT p.wait FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
        history_seq = i.history_seq + 1, updated_at = v_now
    WHERE i.id = p_instance;
    INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, payload, available_at, created_at,
                                     settled_at)
    VALUES (p_instance, '', nextval('{{schema}}.command_seq'), 'MIGRATION', 'COMPLETE',
            jsonb_build_object('from_version', p_from_version, 'to_version', p_to_version,
                               'to_plan_hash', p_to_hash, 'step_map', p_step_map),
            v_now, v_now, v_now)
    RETURNING id INTO v_id;
    INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data)
    VALUES (p_instance, v_inst.history_seq + 1, v_now, 'INSTANCE_MIGRATED',
            (SELECT p.step FROM {{schema}}.positions p WHERE p.instance_id = p_instance AND p.path = ''),
            v_inst.visit, v_id, p_actor,
            jsonb_build_object('from_version', p_from_version, 'from_plan_hash', p_from_hash,
                               'to_version', p_to_version, 'to_plan_hash', p_to_hash,
                               'step_map', p_step_map, 'positions', p_positions, 'state', p_state));
    RETURN QUERY SELECT 'migrated', v_id;
END $$;
