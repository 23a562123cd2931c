-- API tokens of the management HTTP API and the web UI (stepstone serve).
--
-- A token is shown once, when `stepstone tokens create` makes it; only its SHA-256 is kept (a token
-- is 256 random bits, so a fast hash is enough: there is nothing to guess). Each token grants one
-- role in one scope ('*': every scope). Revoking sets revoked_at; the row stays for the record.
CREATE TABLE {{schema}}.api_tokens (
    id uuid PRIMARY KEY,
    name text NOT NULL,
    token_hash text NOT NULL UNIQUE,
    role text NOT NULL CHECK (role IN ('viewer', 'task_worker', 'operator', 'admin')),
    scope text NOT NULL,
    created_at timestamptz NOT NULL,
    created_by text,
    revoked_at timestamptz
);


-- (Newest first within a scope: instances_scope_newest, from migration 0008.)

-- One instance's events, published or not (the instance page; outbox_unsent_instance covers only
-- the unpublished ones).
CREATE INDEX outbox_instance ON {{schema}}.outbox (instance_id, id);
