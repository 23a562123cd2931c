-- A signal, message or task completion queued behind another one on its position waits off the ready walk.
--
-- Commands of one position run one at a time, in queue order: the claim takes a position's head and
-- skips what queues behind it, by looking up, for each ready command it walks, whether an earlier one is
-- still open (claim_heads). The walk goes through commands_ready in available_at order, so every signal
-- queued behind another was walked, and looked up, by every claim of its definition until its turn came:
-- an instance sent a burst of signals made each claim read the whole burst. Measured (an in-process worker
-- of 8 slots on the local PostgreSQL 15, each signal applied by one step that waits for the next): 5
-- instances sent 1,000 signals each took 58.8 s to apply them all, and 2,000 one-step workflows started
-- after them 12.3 s (2.2 s alone); the same 5,000 signals over 1,000 instances, 5 each, took 6.3 s.
--
-- Now a signal, message or task completion recorded while another of those is still open (PENDING,
-- DEFERRED or CLAIMED) ahead of it on its position gets an available_at a minute on (command_recorded), so
-- the claims' walk ends before it; when the one ahead leaves the queue (settled, parked, dead, rejected:
-- any change of state that closes it, whichever statement makes it), a trigger makes the first one still
-- waiting behind it available now, and the requeue trigger's notification wakes the workers. Each queued
-- one waits for its turn off the walk, and at most one a position (its head's next) is walked while
-- blocked. Order is unchanged: the queue is ordered by seq, and the claim still checks the head, so a
-- promotion too early or twice is harmless. A promotion missed (a writer that records one without the
-- instance's row lock, racing the head's settle) costs at most the minute. The first signal behind a
-- running step is recorded available as before (a step's command is not one of those kinds), and so is
-- every signal to a position with nothing of those kinds open: a lone signal's path is unchanged but for
-- one look-up of the queue index when recorded and one trigger call when it is settled.
--
-- Expand only: command_recorded replaced with the same signature; a function and a trigger added.
CREATE OR REPLACE FUNCTION {{schema}}.command_recorded() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
BEGIN
    IF NEW.kind <> 'TASK_COMPLETION' AND NOT (NEW.kind = 'MESSAGE' AND NEW.payload ? 'buffered') THEN
        v_cap := {{schema}}.max_open_signals();
        IF (SELECT count(*) FROM (SELECT 1 FROM {{schema}}.commands c
                                  WHERE c.instance_id = NEW.instance_id AND c.kind IN ('SIGNAL', 'MESSAGE')
                                    AND c.state IN ('PENDING', 'DEFERRED', 'PARKED')
                                  LIMIT v_cap) AS open_ones) >= v_cap THEN
            RAISE EXCEPTION 'stepstone: instance % holds % open signals and messages, the most it may',
                NEW.instance_id, v_cap USING ERRCODE = 'SC429', DETAIL = v_cap::text;
        END IF;
    END IF;
    UPDATE {{schema}}.commands c SET seq = nextval('{{schema}}.command_seq')
    WHERE c.id IN (SELECT x.id FROM {{schema}}.commands x
                   WHERE x.instance_id = NEW.instance_id AND x.position = NEW.position AND x.kind = 'TIMER'
                     -- the queue index, by instance and position (migration 0028)
                     AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND (x.state IN ('PENDING', 'DEFERRED')) IS TRUE AND x.seq < NEW.seq
                     AND (NEW.kind = 'TASK_COMPLETION' OR (x.name = 'timeout' AND x.available_at > NEW.created_at))
                   ORDER BY x.id FOR UPDATE);
    IF EXISTS (SELECT 1 FROM {{schema}}.commands x
               WHERE x.instance_id = NEW.instance_id AND x.position = NEW.position
                 -- the queue index, by instance and position (migration 0028)
                 AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND x.seq < NEW.seq
                 AND x.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION')) THEN
        NEW.available_at := NEW.available_at + interval '1 minute';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION {{schema}}.command_left_queue() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := {{schema}}.db_now();
BEGIN
    UPDATE {{schema}}.commands c SET available_at = v_now
    WHERE c.id = (SELECT x.id FROM {{schema}}.commands x
                  WHERE x.instance_id = NEW.instance_id AND x.position = NEW.position
                    -- the queue index, by instance and position (migration 0028)
                    AND x.state IN ('PENDING', 'DEFERRED', 'CLAIMED') AND x.state = 'PENDING'
                    AND x.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION') AND x.available_at > v_now
                  ORDER BY x.seq, x.id LIMIT 1);
    RETURN NULL;
END $$;

CREATE TRIGGER commands_left_queue
    AFTER UPDATE OF state ON {{schema}}.commands
    FOR EACH ROW WHEN (OLD.kind IN ('SIGNAL', 'MESSAGE', 'TASK_COMPLETION')
                       AND OLD.state IN ('PENDING', 'DEFERRED', 'CLAIMED')
                       AND NEW.state NOT IN ('PENDING', 'DEFERRED', 'CLAIMED'))
    EXECUTE FUNCTION {{schema}}.command_left_queue();
