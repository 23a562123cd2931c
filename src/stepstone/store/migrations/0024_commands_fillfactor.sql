-- Commands fill their pages. Their rows are never updated in place (HOT): every claim and settle
-- changes `state`, which the queue's partial indexes read, so the 30% of each page that fillfactor 70
-- kept free for such updates was never used (0 of 8,800 command updates HOT after 2,000 three-step
-- workflows, docs/performance.md), and a waiting instance's settled START and pending TIMER carried
-- that slack on disk. New pages are filled; existing ones keep their layout until rewritten.
ALTER TABLE {{schema}}.commands SET (fillfactor = 100);
