-- Reactive tasks marked for evaluation (an input changed since their last evaluation) are rows of a narrow
-- table instead of a flag on the wide task row: marking 10,000 tasks inserts 10,000 small rows rather than
-- rewriting 10,000 task rows through every index.

CREATE TABLE reactive_marks (
    scheduler text NOT NULL,
    name      text NOT NULL,
    PRIMARY KEY (scheduler, name)
);

INSERT INTO reactive_marks (scheduler, name) SELECT scheduler, name FROM reactive_tasks WHERE dirty;

DROP INDEX reactive_tasks_dirty;
ALTER TABLE reactive_tasks DROP COLUMN dirty;
