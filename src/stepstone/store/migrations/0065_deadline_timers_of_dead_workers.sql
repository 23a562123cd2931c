-- A deadline's timer held by a worker that died: the commit the deadline holds waited for that worker's lease.
--
-- Migrations 0057 and 0061 hold a deadline at the commit it would otherwise let through: a handler's commit
-- past its step deadline, a signal's, message's or timer's leaving a wait past the wait's step deadline, a
-- commit ending the instance past the instance deadline. The commit fires the deadline there when its timer
-- (on '$saga') is due and free; when a worker holds the timer, the commit is refused (or, leaving a wait, its
-- command parked) and that worker's commit of the timer applies the deadline. A worker that died holding
-- the timer never commits it: the deadline waited until a claim took the expired lease over, while the
-- refused step's command stayed CLAIMED until its own lease expired (and, when that came first, the step ran
-- again and was refused again).
--
-- Now a timer whose lease has expired (the command's and the saga position's, as the claim's takeover reads
-- them) is taken over inside the commit: the saga position's lease is taken from the dead worker (its late
-- commit of the timer is fenced: it finds no lease under its token) and the deadline fires there, as for a
-- due free timer. A timer a live worker holds, or one a claim is taking over at that moment (its rows are
-- skipped when locked, never waited for), is still that worker's to fire.
--
-- The two places in commit_decision that fired a due free timer (the instance deadline at an ending commit,
-- a step deadline at a handler's or leaving commit) repeated the same lock-and-settle; both now call
-- fire_deadline_timer, which carries the free and the expired case. Only those rare commits call it (a
-- commit past a deadline whose timer is found): an ordinary step commit runs exactly the statements it ran.
-- Expand only: one new function, commit_decision replaced with the same signature.
-- The deadline's timer p_timer (on '$saga') fired by the commit of instance p_instance the deadline holds
-- (commit_decision, migrations 0057 and 0061): settled as fired (COMPLETE, by p_worker), true; false, and
-- nothing written, while a live worker holds it. Due and free (no claim, or a claim taking it now: its
-- worker fires it), or held by a worker whose lease has expired (it died, or lost its lease, and no claim
-- has taken it over yet): then the saga position's lease is taken from that worker as a claim would take
-- it (the position first, as the claim locks it), so that its late commit of the timer is fenced.
-- The caller holds the instance row (every commit of the instance waits for it) and its own position; the
-- rows here are skipped when locked, never waited for.
CREATE FUNCTION {{schema}}.fire_deadline_timer(p_instance uuid, p_timer bigint, p_now timestamptz,
                                               p_worker text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_token uuid;
BEGIN
    -- (IS TRUE: by the primary key, never a scan of a partial index, migration 0028.)
    PERFORM 1 FROM {{schema}}.commands x WHERE x.id = p_timer AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        -- An expired lease, as the claim's takeover reads it: the command's and the position's.
        SELECT x.token INTO v_token FROM {{schema}}.commands x
        WHERE x.id = p_timer AND (x.state = 'CLAIMED') IS TRUE AND x.available_at <= p_now;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        PERFORM 1 FROM {{schema}}.positions p
        WHERE p.instance_id = p_instance AND p.path = '$saga' AND p.lease_token = v_token
          AND (p.lease_until IS NULL OR p.lease_until <= p_now)
        FOR UPDATE SKIP LOCKED;  -- a claim taking the expired lease over now: its worker fires it
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        PERFORM 1 FROM {{schema}}.commands x
        WHERE x.id = p_timer AND x.token = v_token AND (x.state = 'CLAIMED') IS TRUE
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL,
            updated_at = p_now
        WHERE p.instance_id = p_instance AND p.path = '$saga' AND p.lease_token = v_token;
    END IF;
    UPDATE {{schema}}.commands c SET state = 'COMPLETE', token = NULL, settled_at = p_now, claimed_by = p_worker
    WHERE c.id = p_timer;
    RETURN true;
END $$;

CREATE OR REPLACE FUNCTION {{schema}}.commit_decision(d jsonb)
RETURNS TABLE (outcome text, continuation bigint, lease_until timestamptz, committed_at timestamptz,
               state_version bigint, state jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := {{schema}}.db_now();
    v_id uuid := (d->>'instance')::uuid;
    v_pos text := d->>'position';
    v_token uuid := (d->>'token')::uuid;
    v_cmd bigint := (d->>'command')::bigint;
    v_move jsonb := NULLIF(d->'move', 'null'::jsonb);
    v_has_state boolean := d ? 'state';
    v_settle text := d->'settle'->>'state';
    v_history jsonb := d->'history';
    v_nhist integer := COALESCE(jsonb_array_length(d->'history'), 0);
    v_notify jsonb := d->'notify';
    v_cont boolean := (d->>'continuation')::boolean;
    v_end text := d->'end'->>'status';
    v_actor text := d->>'actor';
    v_lease timestamptz := CASE WHEN v_cont THEN v_now + make_interval(secs => (d->>'lease_seconds')::float8) END;
    v_follow jsonb := d->'next';
    v_commands jsonb := COALESCE(d->'commands', '[]'::jsonb);
    v_version bigint;
    v_definition text;
    v_pinned integer;
    v_branches integer;
    v_hist integer;
    v_pstatus text;
    v_before text;
    v_stops boolean := false;
    v_side jsonb;
    v_status text;
    v_cur_seq bigint;
    v_next bigint;
    v_state jsonb;
    v_timer jsonb;
    v_timer_at integer;
    v_in_place bigint;
    v_deadline timestamptz;
    v_due bigint;
    v_due_pos text;
    x jsonb;
BEGIN
    -- 1. The instance row (first in the lock order), and the shared state's version.
    SELECT i.state_version, i.branches, i.history_seq, i.definition_id, i.version, i.status, i.deadline_at
    INTO v_version, v_branches, v_hist, v_definition, v_pinned, v_before, v_deadline
    FROM {{schema}}.instances i WHERE i.id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_pinned <> (d->>'version')::integer  -- (a previous release sends no version: NULL, no test)
       OR (v_pos = '$saga' AND v_settle = 'COMPLETE' AND {{schema}}.is_terminal(v_before))
    THEN
        -- A migration moved the instance to another version after this segment's claim read it: a claim
        -- whose statement ran while the migration committed locks the position as the migration left it
        -- but reads the instance row of its snapshot, pin included. What the segment decided followed a
        -- plan the instance no longer has, so nothing of it is written: the claim is given back, and the
        -- command runs again at once under the new plan (migration 0038; the worker counts it fenced).
        -- Likewise a deadline (or step deadline) decided on the saga position while the instance ran, whose
        -- commit comes after another position's commit ended the instance: the saga position's lease is
        -- not the one the end took, so the fence let it through and it compensated a completed instance.
        -- Given back, the timer runs again on the ended instance and is settled STALE (migration 0051).
        WITH pos AS (
            UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL
            WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token
            RETURNING p.path
        )
        UPDATE {{schema}}.commands c SET state = 'PENDING', token = NULL, available_at = v_now,
            claims = GREATEST(c.claims - 1, 0)
        WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE AND EXISTS (SELECT 1 FROM pos);
        RETURN;
    END IF;
    -- A commit that would end the instance once its deadline has passed while the deadline's timer (on
    -- '$saga') has not fired: no slot was free to claim the timer (one slot, or every slot busy), and the
    -- instance completed past its deadline (migration 0061). The deadline wins, as if its timer had fired
    -- just before: nothing of this decision is written, the timer is settled as fired, DEADLINE_PASSED is
    -- recorded and the saga begins (timed_out: every position closed and its lease taken, the open
    -- commands settled, this one too, what the instance completed compensated, then TIMED_OUT), and the
    -- worker counts the commit fenced. A timer a live worker has claimed (or is claiming) is that worker's
    -- to fire: this commit is refused and writes nothing; one whose worker's lease has expired is taken
    -- from it and fired here (fire_deadline_timer, migration 0065). The deadline is on the row this commit
    -- locks, so an ordinary commit pays no lookup: the timer is looked up only by a commit that ends the
    -- instance after its deadline.
    IF v_end IS NOT NULL AND v_deadline <= v_now AND v_before IN ('PENDING', 'RUNNING', 'WAITING') THEN
        SELECT x.id INTO v_due FROM {{schema}}.commands x
        WHERE x.instance_id = v_id AND x.position = '$saga' AND x.kind = 'TIMER' AND x.name = 'deadline'
          AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
        ORDER BY x.id LIMIT 1;
        IF FOUND THEN
            -- This position first (the lock order), fenced as every commit is: a zombie writes nothing.
            PERFORM 1 FROM {{schema}}.positions p
            WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token FOR UPDATE;
            IF FOUND THEN
                -- Settled first (the saga settles every open command, and this one fired), then what the
                -- timer's own commit writes (core/saga.py, _deadline), in the same order.
                IF {{schema}}.fire_deadline_timer(v_id, v_due, v_now, d->>'worker') THEN
                    PERFORM {{schema}}.saga_history(v_id, 'DEADLINE_PASSED', NULL, NULL, '$saga', v_due, v_actor,
                                                    jsonb_build_object('cause', 'timed_out', 'status_before', v_before),
                                                    v_now);
                    PERFORM {{schema}}.saga_begin(v_id, 'timed_out', NULL, v_actor, v_now, '$saga');
                END IF;
            END IF;
            RETURN;
        END IF;
    END IF;
    -- A run of steps going on in place never lets go of its position, so the instance's deadline timer
    -- (on '$saga') waits for a free slot: at one slot, or with every slot busy, it was never taken before
    -- the run ended the instance, which then completed past its deadline (migration 0051). Once the
    -- deadline has passed while its timer is still open, the next step is queued instead (behind the due
    -- timer, which a claim takes first: it is older). The deadline is on the row this commit locks; the
    -- timer is looked up only once it has passed (two IFs: a condition holding a subquery runs as a query
    -- even when its first operand is false).
    IF v_cont AND v_follow IS NOT NULL AND v_deadline <= v_now THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.commands x
                   WHERE x.instance_id = v_id AND x.position = '$saga' AND x.kind = 'TIMER'
                     AND x.name = 'deadline' AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')) THEN
            v_cont := false;
            v_lease := NULL;
            v_commands := v_commands || jsonb_build_array(v_follow || '{"continuation": false}'::jsonb);
            v_follow := NULL;
        END IF;
    END IF;
    -- A handler's run of a step with a deadline (WithinStepDeadline) committing once that deadline has
    -- passed while its timer (on '$saga') has not fired: no slot was free to claim the timer (one slot, or
    -- every slot busy), and the step went on as if in time (migration 0057). The deadline wins: nothing of
    -- this decision is written, the step is interrupted here as the timer would interrupt it (the timer
    -- settled as fired, STEP_DEADLINE_PASSED, the step's commands settled, its position's 'step_deadline'
    -- TIMER queued, which goes to on_deadline), and the worker counts the commit fenced. A timer a live
    -- worker has claimed (or is claiming) is that worker's to fire: this commit is refused and writes
    -- nothing; one whose worker's lease has expired is taken from it and fired here (migration 0065).
    -- A signal, message or timer leaving a wait or timer step with a deadline (`late`) does the same, and
    -- its command is settled as the wait's leaving would settle it (a signal or message PARKED, with its
    -- entry, a timer STALE), its position's lease given back: also while a worker holds the timer (whose
    -- commit interrupts the step), and once the timer has fired and its TIMER waits on this position
    -- behind this command, for a command queued before it would otherwise leave the wait as if in time
    -- (migration 0061). Looked up only for such a commit, and written only once the deadline has passed.
    IF d ? 'step_deadline' THEN
        -- The visit's deadline timer, due or held by a worker (one a visit).
        SELECT x.id, x.position INTO v_due, v_due_pos FROM {{schema}}.commands x
        WHERE x.instance_id = v_id AND x.position = '$saga' AND x.kind = 'TIMER' AND x.name = 'step_deadline'
          AND x.step = d->'step_deadline'->>'step' AND x.visit = (d->'step_deadline'->>'visit')::integer
          AND x.payload->>'position' = v_pos AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
          AND (x.state = 'CLAIMED' OR x.available_at <= v_now)
        ORDER BY x.id LIMIT 1;
        IF NOT FOUND AND d->'step_deadline' ? 'late' THEN
            -- For a command leaving a wait: the TIMER a fired deadline queued on this position for this visit
            -- (a query of its own, by the position's queue index, as the one above).
            SELECT x.id, x.position INTO v_due, v_due_pos FROM {{schema}}.commands x
            WHERE x.instance_id = v_id AND x.position = v_pos AND x.kind = 'TIMER' AND x.name = 'step_deadline'
              AND x.step = d->'step_deadline'->>'step' AND x.visit = (d->'step_deadline'->>'visit')::integer
              AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
            ORDER BY x.id LIMIT 1;
        END IF;
        IF FOUND THEN
            -- This position first (the lock order), fenced as every commit is: a zombie writes nothing.
            PERFORM 1 FROM {{schema}}.positions p
            WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token FOR UPDATE;
            IF FOUND THEN
                -- The deadline's timer (not the TIMER it queued), fired here when no live worker holds it.
                IF v_due_pos = '$saga' THEN
                    IF {{schema}}.fire_deadline_timer(v_id, v_due, v_now, d->>'worker') THEN
                        PERFORM {{schema}}.interrupt_steps(
                            jsonb_build_object('instance', v_id, 'position', '$saga', 'command', v_due,
                                               'actor', v_actor),
                            jsonb_build_array(jsonb_build_object('position', v_pos,
                                                                 'step', d->'step_deadline'->>'step',
                                                                 'visit', (d->'step_deadline'->>'visit')::integer)),
                            v_now);
                    END IF;
                END IF;
                IF d->'step_deadline' ? 'late' THEN
                    -- The deadline has left the wait (here, by the timer's worker, or before): this command
                    -- comes after it, as one applied to a wait already left does (the settle of section 5).
                    v_side := d->'step_deadline'->'late';
                    UPDATE {{schema}}.positions p SET lease_token = NULL, lease_until = NULL, lease_owner = NULL,
                        updated_at = v_now
                    WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token;
                    UPDATE {{schema}}.commands c SET state = v_side->>'state', last_error = v_side->>'reason',
                        claims = CASE WHEN v_side->>'state' = 'PARKED' THEN 0 ELSE c.claims END,
                        settled_at = CASE WHEN v_side->>'state' = 'PARKED' THEN NULL ELSE v_now END
                    WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE;
                    FOR x IN SELECT jsonb_array_elements(v_side->'history') LOOP
                        PERFORM {{schema}}.saga_history(v_id, x->>'kind', x->>'step', (x->>'visit')::integer, v_pos,
                                                        v_cmd, v_actor, NULLIF(x->'data', 'null'::jsonb), v_now);
                    END LOOP;
                END IF;
            END IF;
            RETURN;
        END IF;
    END IF;
    IF v_has_state AND v_version <> (d->>'state_version')::bigint THEN
        -- A writer whose lease is gone learns that first: a zombie never re-runs its step.
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.positions p
                       WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token) THEN
            RETURN;
        END IF;
        -- Another position changed the shared state since this decision read it: carry this
        -- change onto the current state when the two touch different parts of it.
        v_state := {{schema}}.rebase_state((SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id),
                                           d->'changes');
        IF v_state IS NULL THEN
            RETURN QUERY SELECT 'conflict'::text, NULL::bigint, NULL::timestamptz, v_now, v_version,
                                (SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id);
            RETURN;
        END IF;
    END IF;

    -- 2. The fence: this position's lease, moved to its new place.
    UPDATE {{schema}}.positions p SET
        status = COALESCE(v_move->>'status', p.status),
        step = CASE WHEN v_move IS NULL THEN p.step ELSE v_move->>'step' END,
        visit = COALESCE((v_move->>'visit')::integer, p.visit),
        wait = CASE WHEN v_move IS NULL THEN p.wait ELSE NULLIF(v_move->'wait', 'null'::jsonb) END,
        error = CASE WHEN v_move IS NULL THEN p.error ELSE NULLIF(v_move->'error', 'null'::jsonb) END,
        lease_token = CASE WHEN v_cont THEN v_token END,
        lease_until = v_lease,
        lease_owner = CASE WHEN v_cont THEN p.lease_owner END,
        updated_at = v_now
    WHERE p.instance_id = v_id AND p.path = v_pos AND p.lease_token = v_token
    RETURNING p.status INTO v_pstatus;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_pos <> '' AND v_move IS NOT NULL AND v_pstatus IN ('COMPLETED', 'CANCELLED') THEN
        v_branches := v_branches - 1;
    END IF;

    -- 3. Other positions: a fork's branches opened, a join's losers closed (with their children).
    IF d->'open' IS NOT NULL AND d->'open' <> 'null'::jsonb THEN
        v_branches := v_branches + {{schema}}.open_branches(v_id, v_pos, d->'open', v_now);
    END IF;
    IF jsonb_array_length(d->'close') > 0 THEN
        FOR x IN SELECT jsonb_array_elements(d->'close') LOOP
            v_branches := v_branches - {{schema}}.close_branches(v_id, x->>'prefix', x->>'reason', v_now, v_actor);
        END LOOP;
    END IF;

    -- 4. The instance: shared state, status (the root's alone, or all live positions'), history count.
    -- What the instance waits for is its positions' (the root's `wait`), not a copy here (migration 0032).
    -- (IF, not one CASE: a CASE holding a subquery runs as a query on every commit.)
    IF v_end IS NOT NULL THEN
        v_status := v_end;
    ELSIF v_branches = 0 AND v_pos = '' THEN
        v_status := v_pstatus;
    ELSE
        v_status := (SELECT CASE WHEN bool_or(p.status = 'FAILED') THEN 'FAILED'
                                 WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END
                     FROM {{schema}}.positions p
                     WHERE p.instance_id = v_id AND p.status IN ('RUNNING', 'WAITING', 'FAILED'));
        -- Failed branches whose joins can still be met without them do not stop the instance (migration
        -- 0046). Asked only when a position has failed, so not on the way of an ordinary commit.
        IF v_status = 'FAILED' AND NOT {{schema}}.failures_stop(v_id) THEN
            v_status := (SELECT CASE WHEN bool_or(p.status = 'RUNNING') THEN 'RUNNING' ELSE 'WAITING' END
                         FROM {{schema}}.positions p
                         WHERE p.instance_id = v_id AND p.status IN ('RUNNING', 'WAITING'));
        END IF;
    END IF;
    IF v_pstatus = 'FAILED' THEN
        -- This commit's failure stops the instance: the root's always; a branch's (IfStopped) when it is
        -- the one that stopped an instance not stopped before (a later one is passed over: one
        -- INSTANCE_FAILED, one error, one word to the parent), counted here, under the instance's lock.
        v_stops := NOT (d ? 'if_stopped') OR (v_before <> 'FAILED' AND v_status = 'FAILED');
    END IF;
    IF d ? 'if_stopped' THEN  -- a branch's failure: INSTANCE_FAILED (and the parent told), or BRANCH_FAILED
        v_side := d->'if_stopped'->(CASE WHEN v_stops THEN 'stopped' ELSE 'passed' END);
        v_history := COALESCE(v_history, '[]'::jsonb) || COALESCE(v_side->'history', '[]'::jsonb);
        v_nhist := jsonb_array_length(v_history);
        v_notify := COALESCE(v_notify, '[]'::jsonb) || COALESCE(v_side->'notify', '[]'::jsonb);
    END IF;
    UPDATE {{schema}}.instances i SET
        status = COALESCE(v_status, i.status),
        state = CASE WHEN v_state IS NOT NULL THEN v_state WHEN v_has_state THEN d->'state' ELSE i.state END,
        state_version = i.state_version + CASE WHEN v_has_state THEN 1 ELSE 0 END,
        error = CASE WHEN v_stops THEN v_move->'error' ELSE i.error END,
        step = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN v_move->>'step' ELSE i.step END,
        visit = CASE WHEN v_pos = '' AND v_move IS NOT NULL THEN (v_move->>'visit')::integer ELSE i.visit END,
        history_seq = i.history_seq + v_nhist,
        branches = v_branches,
        updated_at = v_now,
        ended_at = CASE WHEN v_end IS NOT NULL THEN v_now ELSE i.ended_at END
    WHERE i.id = v_id
    RETURNING i.state_version INTO v_version;

    -- 5. Settle the claimed command, fenced on the same token; or, for a continuation from a step's own
    -- command (START, STEP, RETRY), go on in that row, which keeps its kind (what began the run): one
    -- update of the row the worker holds, where a settle and an insert of the next step's command wrote
    -- two rows and six index entries (docs/performance.md, "The continuation in place"). What arrived
    -- from outside (a signal, a message, a timer, a child's or task's completion) stays settled as its
    -- own record, and so does a row whose payload this commit redacts. Fenced on the same token either way.
    IF v_follow IS NOT NULL AND NOT COALESCE(d->'ext' ? 'redacted_payloads', false) THEN
        -- No indexed column changes, so the update may be HOT: the lease expiry stays where the claim or
        -- the last renewal put it (the renewals move it on); the position's lease, moved above, is the
        -- one a claim of an expired lease goes by.
        UPDATE {{schema}}.commands c SET
            step = v_follow->>'step', visit = (v_follow->>'visit')::integer,
            payload = NULLIF(v_follow->'payload', 'null'::jsonb),
            attempt = 1, claims = 1, deferrals = 0, claimed_by = d->>'worker', last_error = NULL,
            created_at = v_now
        WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE
          AND c.kind IN ('START', 'STEP', 'RETRY')
        RETURNING c.id INTO v_next;
    END IF;
    -- A step's own command whose step ends in a timed wait on its position becomes the wait's timer
    -- (migration 0035): one update of the claimed row, where a settle and an insert wrote two rows, and a
    -- waiting instance keeps one command row, not two (docs/performance.md, "The timer in place"). The
    -- timer takes a fresh seq (it queues behind what arrived while the step ran, as an inserted one did)
    -- and every column an inserted timer sets; the token stays, so `settled_by` still tells a worker whose
    -- commit outcome was lost that its claim settled (until the timer's own claim replaces it). Not when
    -- the commit closes timers (it would close this one), ends the instance, or redacts the payload.
    IF v_next IS NULL AND v_follow IS NULL AND v_settle = 'COMPLETE' AND v_end IS NULL
       AND NOT COALESCE((d->>'close_timers')::boolean, false)
       AND NOT COALESCE(d->'ext' ? 'redacted_payloads', false) AND jsonb_array_length(v_commands) > 0 THEN
        -- The position's first new command, when it is a timer: its queue then orders as it did.
        SELECT x.ord - 1, x.c INTO v_timer_at, v_timer
        FROM jsonb_array_elements(v_commands) WITH ORDINALITY AS x(c, ord)
        WHERE COALESCE(x.c->>'position', v_pos) = v_pos
        ORDER BY x.ord LIMIT 1;
        IF v_timer->>'kind' = 'TIMER' THEN
            UPDATE {{schema}}.commands c SET
                seq = nextval('{{schema}}.command_seq'), kind = 'TIMER', state = 'PENDING',
                step = v_timer->>'step', visit = (v_timer->>'visit')::integer, name = v_timer->>'name',
                payload = NULLIF(v_timer->'payload', 'null'::jsonb), dedup_key = NULL, attempt = 1, claims = 0,
                deferrals = 0,
                available_at = COALESCE((v_timer->>'at')::timestamptz,
                                        v_now + make_interval(secs => COALESCE((v_timer->>'delay')::float8, 0))),
                claimed_by = NULL, last_error = NULL, created_at = v_now, settled_at = NULL, actor = NULL,
                context = NULL
            WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE
              AND c.kind IN ('START', 'STEP', 'RETRY')
            RETURNING c.id INTO v_in_place;
            IF v_in_place IS NOT NULL THEN
                v_commands := v_commands - v_timer_at;
            END IF;
        END IF;
    END IF;
    IF v_next IS NULL AND v_in_place IS NULL THEN
        UPDATE {{schema}}.commands c SET
            state = CASE v_settle WHEN 'RETRY' THEN 'PENDING' ELSE v_settle END,
            available_at = CASE v_settle
                WHEN 'RETRY' THEN v_now + make_interval(secs => (d->'settle'->>'retry_delay')::float8)
                ELSE c.available_at END,
            attempt = CASE v_settle WHEN 'RETRY' THEN c.attempt + 1 ELSE c.attempt END,
            claims = CASE WHEN v_settle IN ('RETRY', 'PARKED') THEN 0 ELSE c.claims END,
            -- The token stays on the settled row: it tells a worker whose commit
            -- outcome was unknown that this claim did settle it.
            last_error = d->'settle'->>'reason',
            settled_at = CASE WHEN v_settle IN ('RETRY', 'PARKED', 'DEAD') THEN NULL ELSE v_now END
        -- IS TRUE: the lookup goes through the primary key, never a scan of a partial index (migration 0028).
        WHERE c.id = v_cmd AND c.token = v_token AND (c.state = 'CLAIMED') IS TRUE
        RETURNING c.seq INTO v_cur_seq;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'stepstone: command % is not claimed under the token that holds instance % position %',
                v_cmd, v_id, v_pos USING ERRCODE = 'P0001';
        END IF;
        IF v_follow IS NOT NULL THEN
            v_commands := v_commands || jsonb_build_array(v_follow);  -- inserted below, already claimed
        END IF;
    END IF;

    -- 6. Other commands of this instance, in ascending id order.
    IF d ? 'queued' THEN
        -- Join reports queued behind the claimed one, carried out with it (SettleQueued, migration 0037);
        -- before the blocks below, which would reject them as leftovers of an instance this commit ends.
        UPDATE {{schema}}.commands c SET state = 'COMPLETE', settled_at = v_now, claimed_by = d->>'worker'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.id IN (SELECT jsonb_array_elements_text(d->'queued')::bigint)
                         AND x.instance_id = v_id AND x.position = v_pos
                         -- IS TRUE: by the primary key, never a scan of a partial index (migration 0028)
                         AND (x.state = 'PENDING') IS TRUE
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF (d->>'close_timers')::boolean THEN
        UPDATE {{schema}}.commands c SET state = 'SUPERSEDED', token = NULL, settled_at = v_now,
            last_error = 'WAIT_LEFT'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.position = v_pos AND x.kind = 'TIMER'
                         -- the queue index, by instance and position (migration 0028)
                         AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF v_end IS NOT NULL THEN
        UPDATE {{schema}}.commands c SET state = 'REJECTED', token = NULL, settled_at = v_now,
            last_error = 'INSTANCE_ENDED'
        WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                       WHERE x.instance_id = v_id AND x.id <> v_cmd
                         AND x.state IN ('PENDING', 'DEFERRED', 'PARKED', 'DEAD')
                       ORDER BY x.id FOR UPDATE);
    END IF;
    IF jsonb_array_length(d->'requeue') > 0 THEN
        UPDATE {{schema}}.commands c SET state = 'PENDING', available_at = v_now, claims = 0
        WHERE c.id = (SELECT x.id FROM {{schema}}.commands x
                      WHERE x.instance_id = v_id AND x.position = v_pos AND x.state = 'PARKED' AND x.kind = 'SIGNAL'
                        AND x.name IN (SELECT jsonb_array_elements_text(d->'requeue'))
                      ORDER BY x.seq, x.id LIMIT 1);
    END IF;
    IF jsonb_array_length(v_commands) > 0 THEN
        WITH ins AS (
            INSERT INTO {{schema}}.commands AS c
                (instance_id, definition, position, seq, kind, state, step, visit, name, payload, attempt,
                 claims, available_at, token, claimed_by, created_at)
            SELECT v_id, v_definition, COALESCE(x.c->>'position', v_pos),
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_cur_seq ELSE nextval('{{schema}}.command_seq') END,
                   x.c->>'kind',
                   CASE WHEN (x.c->>'continuation')::boolean THEN 'CLAIMED' ELSE 'PENDING' END,
                   x.c->>'step', (x.c->>'visit')::integer, x.c->>'name', NULLIF(x.c->'payload', 'null'::jsonb),
                   1,
                   CASE WHEN (x.c->>'continuation')::boolean THEN 1 ELSE 0 END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_lease
                        ELSE COALESCE((x.c->>'at')::timestamptz,
                                      v_now + make_interval(secs => COALESCE((x.c->>'delay')::float8, 0)))
                   END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN v_token END,
                   CASE WHEN (x.c->>'continuation')::boolean THEN d->>'worker' END,
                   v_now
            FROM jsonb_array_elements(v_commands) WITH ORDINALITY AS x(c, ord)
            ORDER BY x.ord
            RETURNING c.id, c.state
        )
        SELECT COALESCE((SELECT ins.id FROM ins WHERE ins.state = 'CLAIMED'), v_next) INTO v_next;
    END IF;

    -- 7. Child instances: started by this step, or told that this one ended.
    IF jsonb_array_length(d->'children') > 0 THEN
        PERFORM {{schema}}.start_children(v_id, v_pos, (v_move->>'visit')::integer, d->'children', v_now, v_actor);
    END IF;
    IF jsonb_array_length(v_notify) > 0 THEN
        INSERT INTO {{schema}}.commands (instance_id, position, seq, kind, state, visit, payload, available_at,
                                         created_at)
        SELECT (n->>'parent_id')::uuid, n->>'position', nextval('{{schema}}.command_seq'), 'CHILD_COMPLETION',
               'PENDING', (n->>'visit')::integer, n->'payload', v_now, v_now
        FROM jsonb_array_elements(v_notify) AS n;
    END IF;

    -- 7b. Feature sections (effect_sections), in rank order: the rows a feature added after the core
    -- (tasks, subscriptions, compensations, ...) come after the commands and children in the lock order
    -- and before history and the outbox. A decision that uses none leaves 'ext' out: no lookup.
    IF d ? 'ext' THEN
        FOR x IN SELECT to_jsonb(s) FROM {{schema}}.effect_sections s
                 WHERE d->'ext' ? s.section ORDER BY s.rank, s.section LOOP
            EXECUTE format('SELECT {{schema}}.%I($1, $2, $3)', x->>'function_name')
                USING d, d->'ext'->(x->>'section'), v_now;
        END LOOP;
    END IF;

    -- 8. History, then outbox.
    IF v_nhist > 0 THEN
        INSERT INTO {{schema}}.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
        SELECT v_id, v_hist + x.ord::integer, v_now, x.h->>'kind', x.h->>'step',
               (x.h->>'visit')::integer, v_cmd, v_actor, NULLIF(x.h->'data', 'null'::jsonb), v_pos
        FROM jsonb_array_elements(v_history) WITH ORDINALITY AS x(h, ord);
    END IF;
    IF jsonb_array_length(d->'events') > 0 THEN
        INSERT INTO {{schema}}.outbox (event_id, instance_id, type, key, payload, created_at)
        SELECT (e->>'event_id')::uuid, v_id, e->>'type', e->>'key', e->'payload', v_now
        FROM jsonb_array_elements(d->'events') AS e;
    END IF;

    -- Work this segment was blocking (a signal queued behind it) is runnable now. (Two IFs: a
    -- condition holding a subquery runs as a query even when its first operand is false.)
    IF NOT v_cont AND v_end IS NULL THEN
        IF EXISTS (SELECT 1 FROM {{schema}}.commands x
                   WHERE x.instance_id = v_id AND x.position = v_pos
                     -- the queue index, by instance and position (migration 0028)
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE
                     AND x.available_at <= v_now) THEN
            PERFORM pg_notify('stepstone_' || (SELECT c.relnamespace::regnamespace::text FROM pg_class c
                                               WHERE c.oid = '{{schema}}.commands'::regclass),
                              (extract(epoch FROM v_now) * 1000)::bigint::text || ':' || v_definition);
        END IF;
    END IF;

    -- A decision that wrote no state, made on a version another position has moved on since: the worker
    -- goes on from the current state, not the one it claimed (migration 0037). Else a join that fires
    -- while a branch commits would hand its next step the state from before that branch's change, under
    -- the new version, and the step's commit would write over the change.
    IF NOT v_has_state AND v_version <> (d->>'state_version')::bigint THEN
        v_state := (SELECT i.state FROM {{schema}}.instances i WHERE i.id = v_id);
    END IF;

    -- (OUT parameters and RETURN NEXT, not RETURN QUERY: no query to run for the one row.)
    outcome := CASE WHEN v_state IS NULL THEN 'ok' ELSE 'merged' END;
    continuation := v_next;
    lease_until := v_lease;
    committed_at := v_now;
    state_version := v_version;
    state := v_state;  -- the merged state, when this change was carried onto a newer one
    RETURN NEXT;
END $$;
