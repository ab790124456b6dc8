-- A check two code locations both evaluate on one asset (the reactive scheduler's tick age on the default tasks
-- asset) keeps one state per location: ``scope`` names the location's part (its scheduler), '' for the others.
ALTER TABLE check_states ADD COLUMN scope text NOT NULL DEFAULT '';
ALTER TABLE check_states DROP CONSTRAINT check_states_pkey;
ALTER TABLE check_states ADD PRIMARY KEY (asset, check_name, scope);
ALTER TABLE check_transitions ADD COLUMN scope text NOT NULL DEFAULT '';
