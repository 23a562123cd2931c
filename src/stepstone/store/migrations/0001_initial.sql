-- Placeholder initial schema; the real one replaces it.
CREATE TABLE {{schema}}.placeholder (
    id int PRIMARY KEY
);
