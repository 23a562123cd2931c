-- Publishing a message inside the caller's own transaction (Client.publish_message(connection=...)).
--
-- publish_message takes each matching instance's row with NOWAIT, so a publish never waits behind a
-- worker's commit while it holds the correlation lock; on a pool connection the client tries again.
-- On the caller's connection an error would abort the caller's whole transaction, business write
-- included, so this function tries again itself: each attempt runs in a subtransaction (the
-- EXCEPTION block), so a refused attempt leaves nothing behind, its locks included. The instance cap
-- (SQLSTATE SC429) and a matching instance that stays busy come back as outcomes ('limit', 'busy'),
-- not errors: the caller's transaction stays usable, as after a refused start.
CREATE FUNCTION {{schema}}.publish_in_caller_transaction(p_name text, p_key text, p_payload jsonb,
                                                         p_message_id text, p_ttl float8, p_all boolean,
                                                         p_fingerprint text)
RETURNS TABLE (outcome text, deliveries jsonb, expires_at timestamptz, status text, detail text,
               cap integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_delay float8 := 0.002;
    v_detail text;
    v_cap text;
BEGIN
    -- About five seconds in all, as the client's own retries (postgres_tasks._BUSY_ATTEMPTS).
    FOR attempt IN 1..200 LOOP
        BEGIN
            RETURN QUERY SELECT m.outcome, m.deliveries, m.expires_at, m.status, NULL::text,
                                NULL::integer
                         FROM {{schema}}.publish_message(p_name, p_key, p_payload, p_message_id, p_ttl, p_all,
                                                         p_fingerprint) AS m;
            RETURN;
        EXCEPTION
            WHEN lock_not_available THEN
                PERFORM pg_sleep(v_delay);
                v_delay := least(v_delay * 2, 0.05);
            WHEN SQLSTATE 'SC429' THEN
                GET STACKED DIAGNOSTICS v_detail = MESSAGE_TEXT, v_cap = PG_EXCEPTION_DETAIL;
                RETURN QUERY SELECT 'limit'::text, '[]'::jsonb, NULL::timestamptz, 'LIMIT'::text, v_detail,
                                    v_cap::integer;
                RETURN;
        END;
    END LOOP;
    RETURN QUERY SELECT 'busy'::text, '[]'::jsonb, NULL::timestamptz, 'BUSY'::text, NULL::text, NULL::integer;
END $$;
