-- Crashes count on a command only by the claims in which it ran alone (docs/guarantees.md, "Poison
-- command").
--
-- A command claimed again after a claim that ended without a commit (a suspect) runs alone in its
-- worker (runtime/alone.py), so a crash of that run falls on it. But the dead letter counted every claim
-- without a commit: the first crash counted on all the commands the dead worker held, and with
-- max_claims 1 each of them was dead-lettered, the innocent sibling branches too. Now a worker marks a
-- suspect's claim when it runs it alone (one update of the command row, on suspects only), and a command
-- is dead-lettered when max_claims of its earlier claims ran alone and none committed. The mark reads how
-- many earlier claims ran alone: at most claims - 2 of them (a suspect's first claim, claims 1, never
-- runs alone), which drops the count of a command settled or rescheduled since (its claims started
-- again from 0 or 1). A claim given back (release) gives back its mark too.
-- Expand only: two columns added.

-- The claims of this command in which it ran alone in its worker (runtime/alone.py) and which did not
-- commit, and the token of the last of them (a release of that claim takes its mark back).
-- NULL until a claim runs alone: a column with a default of 0 made every command row, a waiting instance's
-- timer too, 7 bytes larger (tests/perf/waiting_bytes.py: 2,137 -> 2,144 bytes a waiting instance).
ALTER TABLE {{schema}}.commands ADD COLUMN alone_claims integer;
ALTER TABLE {{schema}}.commands ADD COLUMN alone_token uuid;
