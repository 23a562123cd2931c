-- Waiting instances fill more of their pages. Instances and positions kept 30% of each page free
-- (fillfactor 70) so that an update finds room for the row's new version on the same page (a HOT
-- update: no new index entries). A fifth is enough for that: no row is kept in line above about 2 KB
-- (larger values are compressed or moved to TOAST first), and at fillfactor 80 a page keeps at least
-- 1,638 bytes free, or holds at most three rows of more than 1,632 bytes and so keeps 2,060 free. The
-- share of HOT updates did not move (25% of instance updates with a 1.5 KB state, 33% with 100 bytes,
-- 100% of position updates, at 70 and at 80 alike), while fuller pages would lose them: at 90 or 100,
-- with a 1.5 KB state, 0-7% of instance updates were HOT (docs/performance.md, "Waiting rows fill
-- more of their pages"). The slack followed every waiting instance on disk. New pages are filled to
-- the new factor; existing ones keep their layout until rewritten. The lock this takes does not block
-- reads or writes.
ALTER TABLE {{schema}}.instances SET (fillfactor = 80);
ALTER TABLE {{schema}}.positions SET (fillfactor = 80);
