-- A child that completed in a branch its join did not need is compensated with the branch's steps.
--
-- When a join is met with branches still under way (need "any" or a count), it closes them (close_branches,
-- JOIN_COMPLETE); what those branches completed stays among the instance's compensations, and a later saga of
-- the instance undoes it with the rest (docs/sagas.md, "Order, branches and children"). A child step's child
-- that had COMPLETED there, whose report (CHILD_COMPLETION) the branch had not applied yet (queued, or claimed
-- by a worker applying it, or one that died), was not: close_branches settled the report CANCELLED unapplied,
-- the child, ended, was not cancelled, and nothing recorded it, so the saga left its steps done while it undid
-- the branch's steps before it (tests/sagas/test_join_losers.py, test_a_child_whose_report_waits_in_a_branch_
-- the_join_closed_is_compensated printed "AssertionError: assert 'COMPLETED' == 'COMPENSATED'"). A child whose
-- report the branch had applied was recorded then (core/saga.py, on_child_completed) and is compensated, as
-- before. close_branches now records such a child as the report would have recorded it (in a plan that declares
-- a compensation, a child that goes with its parent), as saga_begin records one (record_open_children, version
-- 90); both read them through reported_children. close_branches reads them after it has cancelled the children
-- still running: one whose last commit lands while the join commits is either cancelled (cancel_tree locks it
-- first) or, its commit waited for, seen COMPLETED with its branch closed while waiting for it, never neither.

CREATE FUNCTION {{schema}}.reported_children(p_instance uuid, p_prefix text, p_closed text[])
RETURNS TABLE (child_id uuid, path text, step text, visit integer)
LANGUAGE sql STABLE AS $$
    SELECT c.id, x.path, x.step, x.visit
    FROM {{schema}}.positions x
    JOIN {{schema}}.instances c ON c.id = (x.wait->>'child_id')::uuid
    WHERE x.instance_id = p_instance AND left(x.path, length(p_prefix)) = p_prefix
      AND (x.status = 'WAITING' AND p_closed IS NULL OR x.status = 'CANCELLED' AND x.path = ANY (p_closed))
      AND x.wait->>'kind' = 'child'
      AND c.parent_id = p_instance AND c.status = 'COMPLETED' AND c.cancel_with_parent
      AND COALESCE(c.parent_position, '') = x.path AND c.parent_visit = x.visit
      AND EXISTS (SELECT 1 FROM {{schema}}.commands r
                  WHERE r.instance_id = p_instance AND r.position = x.path AND r.kind = 'CHILD_COMPLETION'
                    AND (CASE WHEN p_closed IS NULL THEN r.state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')
                              ELSE r.state <> 'COMPLETE' END) IS TRUE
                    AND r.visit = x.visit AND r.payload->>'child_id' = c.id::text
                    AND r.payload->>'status' = 'COMPLETED')
      AND EXISTS (SELECT 1 FROM {{schema}}.instances i
                  JOIN {{schema}}.definitions d ON d.scope IN (i.definition_scope, i.scope)
                       AND d.definition_id = i.definition_id AND d.version = i.version
                       AND d.plan_hash = i.plan_hash
                  CROSS JOIN LATERAL jsonb_array_elements(d.plan->'steps') AS s
                  WHERE i.id = p_instance AND s ? 'compensation')
$$;

CREATE OR REPLACE FUNCTION {{schema}}.record_open_children(p_instance uuid, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT p_instance, t.path, t.step, t.visit, t.recorded, p_now
    FROM (
        SELECT 1 AS part, r.child_id AS id, r.path, r.step, r.visit,
               jsonb_build_object('kind', 'child', 'child_id', r.child_id) AS recorded
        FROM {{schema}}.reported_children(p_instance, '', NULL) r
        UNION ALL
        SELECT 2, c.id, coalesce(c.parent_position, ''),
               coalesce((SELECT p.step FROM {{schema}}.positions p
                         WHERE p.instance_id = p_instance AND p.path = coalesce(c.parent_position, '')
                           AND p.visit = c.parent_visit), c.definition_id),
               coalesce(c.parent_visit, 0), jsonb_build_object('kind', 'child', 'child_id', c.id, 'open', true)
        FROM {{schema}}.instances c
        WHERE c.parent_id = p_instance AND c.cancel_with_parent AND c.ended_at IS NULL
    ) AS t
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.compensations k
                      WHERE k.instance_id = p_instance AND k.recorded->>'kind' = 'child'
                        AND k.recorded->>'child_id' = t.id::text)
    ORDER BY t.part, t.id;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.close_branches(p_instance uuid, p_prefix text, p_reason text,
                                                     p_now timestamptz, p_actor text)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
    v_len integer := length(p_prefix);
    v_child uuid;
    v_closed text[];
BEGIN
    WITH closed AS (
        UPDATE {{schema}}.positions p SET status = 'CANCELLED', lease_token = NULL, lease_until = NULL,
            lease_owner = NULL, updated_at = p_now
        WHERE (p.instance_id, p.path) IN (SELECT x.instance_id, x.path FROM {{schema}}.positions x
                                          WHERE x.instance_id = p_instance AND left(x.path, v_len) = p_prefix
                                            AND x.status NOT IN ('COMPLETED', 'CANCELLED')
                                          ORDER BY x.path FOR UPDATE)
        RETURNING p.path)
    SELECT coalesce(array_agg(c.path), '{}') INTO v_closed FROM closed c;
    v_n := cardinality(v_closed);
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
    -- A child that completed in a branch closed here, its report not applied: recorded as the report would
    -- have (version 92). Read after the loop: a child whose last commit landed meanwhile was waited for by
    -- cancel_tree, so it is seen COMPLETED now.
    INSERT INTO {{schema}}.compensations (instance_id, position, step, visit, recorded, completed_at)
    SELECT p_instance, r.path, r.step, r.visit, jsonb_build_object('kind', 'child', 'child_id', r.child_id), p_now
    FROM {{schema}}.reported_children(p_instance, p_prefix, v_closed) r
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.compensations k
                      WHERE k.instance_id = p_instance AND k.recorded->>'kind' = 'child'
                        AND k.recorded->>'child_id' = r.child_id::text)
    ORDER BY r.child_id;
    RETURN v_n;
END $$;
