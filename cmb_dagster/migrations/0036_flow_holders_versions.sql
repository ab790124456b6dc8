-- A slot row names the worker holding it (the same name for every slot it holds); a scope's limits carry the
-- version of their definition, and a registration of a lower version leaves them as they are.
ALTER TABLE flow_slots RENAME COLUMN item TO holder;
ALTER TABLE flow_limits ADD COLUMN version integer NOT NULL DEFAULT 0 CHECK (version >= 0);
