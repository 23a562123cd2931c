-- A join that closes a branch it does not need leaves that branch's children that already ended as they
-- are. close_branches cancelled every child that was not COMPLETED or CANCELLED, a FAILED one among
-- them: a branch whose child failed, passed over by a join that needs fewer than all, had its FAILED
-- child turned CANCELLED when the join was met, which erased the record of the failure and moved it
-- from retention's failed class to its completed one. A child still running is cancelled as before.
-- Expand only: close_branches replaced with the same signature.

-- Cancel the live branches under a path prefix (a join's losers): their positions, open commands
-- and the children still running (one that ended is a record, FAILED ones above all). Returns how many
-- positions it closed.
CREATE OR REPLACE FUNCTION {{schema}}.close_branches(p_instance uuid, p_prefix text, p_reason text, p_now timestamptz,
                                          p_actor text)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
    v_len integer := length(p_prefix);
    v_child uuid;
BEGIN
    UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
        lease_owner = NULL, updated_at = p_now
    WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                      WHERE x.instance_id = p_instance AND left(x.path, v_len) = p_prefix
                                        AND x.status NOT IN ('COMPLETED', 'CANCELLED')
                                      ORDER BY x.path FOR UPDATE);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE {{schema}}.commands c SET state = 'CANCELLED', token = NULL, settled_at = p_now,
        last_error = 'BRANCH_CANCELLED: ' || p_reason
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = p_instance AND left(x.position, v_len) = p_prefix
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')
                   ORDER BY x.id FOR UPDATE);
    FOR v_child IN SELECT i.id FROM {{schema}}.instances i
                   WHERE i.parent_id = p_instance AND left(i.parent_position, v_len) = p_prefix
                     AND i.cancel_with_parent AND NOT {{schema}}.is_ended(i.status) ORDER BY i.id LOOP
        PERFORM {{schema}}.cancel_tree(v_child, 'branch cancelled: ' || p_reason, p_actor, false);
    END LOOP;
    RETURN v_n;
END $$;
