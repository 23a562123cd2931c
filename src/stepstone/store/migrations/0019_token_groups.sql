-- The groups an API token's user belongs to: the task inbox offers that user the tasks whose
-- candidate groups include one of them (`stepstone tokens create --group finance`). Empty for the
-- tokens made before, which keep working as they did (tasks assigned to them or offered to their name).
ALTER TABLE {{schema}}.api_tokens ADD COLUMN groups text[] NOT NULL DEFAULT '{}';
