-- Waiting instances fill their pages. An instance row is updated in place (HOT) only while its status
-- stays: every change of status (a wait, a wake-up, an end) writes a new entry in
-- instances_status_created and is never HOT, and the 30% of each page that fillfactor 70 kept free did
-- not raise the share that is: 32-33% of instance updates were HOT at fillfactor 70 and at 100 alike
-- (three-step workflows, docs/performance.md "Waiting rows fill their pages"). A position's updates
-- (claims, renewals, moves) touch no indexed column, and they stay HOT with a tenth of the page free
-- (99-100% at 90, 96-97% at 100). What the slack did do is follow every waiting instance on disk:
-- its row and its root position. New pages are filled to the new factor; existing ones keep their
-- layout until rewritten. The lock this takes does not block reads or writes.
ALTER TABLE {{schema}}.instances SET (fillfactor = 100);
ALTER TABLE {{schema}}.positions SET (fillfactor = 90);
