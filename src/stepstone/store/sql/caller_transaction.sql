-- Statements run on the caller's own connection, inside its transaction (store/caller_transaction.py).
-- Written for any driver: parameters are $n, each used once and in order (rewritten to %s for psycopg
-- and to :pn for SQLAlchemy), every one passed as text and cast here (CAST, not ::, for SQLAlchemy; cast to text first, so
-- asyncpg infers text for every parameter).

-- name: start
-- The instance deadline (an instant, or seconds from now) and the start step's deadline (its step and
-- seconds: the last two parameters) only for an instance this call created.
SELECT r.outcome, r.target, r.fingerprint FROM {{schema}}.start_in_caller_transaction(
    CAST(CAST($1 AS text) AS uuid), CAST($2 AS text), CAST($3 AS text), CAST(CAST($4 AS text) AS integer), CAST($5 AS text),
    CAST(CAST($6 AS text) AS jsonb), CAST($7 AS text), CAST($8 AS text), CAST($9 AS text), CAST($10 AS text),
    CAST($11 AS text), CAST(CAST($12 AS text) AS jsonb)) AS r
LEFT JOIN LATERAL (SELECT {{schema}}.schedule_start_deadlines(
                       CAST(r.target AS uuid), CAST(CAST($13 AS text) AS timestamptz), CAST(CAST($14 AS text) AS float8),
                       CAST($15 AS text), CAST(CAST($16 AS text) AS float8))
                   WHERE r.outcome = 'started') AS d ON true;

-- name: signal
SELECT outcome, command_id, status FROM {{schema}}.signal_with_context(
    CAST(CAST($1 AS text) AS uuid), CAST($2 AS text), CAST($3 AS text), CAST(CAST($4 AS text) AS jsonb),
    CAST($5 AS text), CAST($6 AS text), CAST($7 AS text), CAST(CAST($8 AS text) AS jsonb));

-- name: publish
-- deliveries as text, since a plain asyncpg connection has no jsonb codec (the other drivers decode it).
-- cap: the limit a refusal names; for a 'full' buffer (which the function answers without one) max_open_signals.
SELECT outcome, CAST(deliveries AS text) AS deliveries, expires_at, status, detail,
       COALESCE(cap, {{schema}}.max_open_signals()) AS cap
FROM {{schema}}.publish_in_caller_transaction(
    CAST($1 AS text), CAST($2 AS text), CAST(CAST($3 AS text) AS jsonb), CAST($4 AS text),
    CAST(CAST($5 AS text) AS float8), CAST(CAST($6 AS text) AS boolean), CAST($7 AS text));
