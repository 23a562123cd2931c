-- Saved inbox filters (issue 11): a user names a filter of the task inbox (its mode and its
-- narrowing, as the client's TaskFilter spells it) and lists, uses and deletes it later. One row per
-- (scope, owner, name); saving a name again replaces its filter. Nothing else reads or locks this
-- table, so it takes no place in the lock order.
CREATE TABLE {{schema}}.task_filters (
    scope text NOT NULL,
    owner text NOT NULL,
    name text NOT NULL,
    mode text NOT NULL,
    filter jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (scope, owner, name)
);
