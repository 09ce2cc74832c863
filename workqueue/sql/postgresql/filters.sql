-- Attribute filters: the grammar check (wq_filter_problem), the matcher the fan-out runs
-- (wq_filter_matches) and the guard that keeps invalid filters out of workqueue_subscription
-- (the CHECK constraint wq_sub_filter_valid). These are the SQL twins of
-- workqueue.filters.stored_filter_problem and stored_filter_matches and must decide exactly as
-- they do, for valid and invalid filters alike; tests/driver/test_filter_sql_parity.py checks
-- that on a corpus of rejected filters and on generated ones. Idempotent: safe to run repeatedly.

-- The guard stays in place while the functions it calls are replaced (PostgreSQL allows that;
-- SQL Server does not, and drops and adds it again there). It is added at the end of this file
-- only when missing: adding or dropping a constraint locks workqueue_subscription against every
-- reader, each claim and publish among them, until the migrate commits.

-- wq_filter_problem(p_filter jsonb) RETURNS text
--
-- Why a stored filter is invalid, as "<path>: <problem>" naming the part at fault the way
-- workqueue.filters.FilterError does (e.g. "filter.filters[1].operator: ..."), or NULL when it
-- is valid: SQL NULL, JSON null, {} and an empty "filters" list (no filter), or an object that
-- follows the grammar of workqueue/filters.py, checked in the same order:
--   root      {"logic": "and", "filters": [CLAUSE, ...]}, no other key
--   CLAUSE    a condition, or {"logic": "or", "filters": [condition, ...]} (a group: at least
--             one member, every member an "eq" condition on one and the same field)
--   condition {"field": NAME, "operator": OP, "value": STRING}, no other key; NAME matches
--             [A-Za-z0-9_-]{1,64}; OP is eq, neq, startswith (a non-empty string value) or
--             isnull, isnotnull (no value, or JSON null)
--   limits    each field constrained once (a group counts once), at most 5 fields and at most
--             50 values in all (group members counted as written).
-- Reads no tables and calls only built-in functions; it is executable by PUBLIC because
-- PostgreSQL checks EXECUTE on a constraint's functions as the role that writes the row. Its
-- search_path is pinned to pg_catalog: the CHECK constraint runs it in the writer's session
-- (the owner's, during migrate or loaddata), where an operator planted in a writable schema
-- (say jsonb ->> jsonb, which beats the built-in ->> for an untyped literal) would otherwise
-- run as that writer.
CREATE OR REPLACE FUNCTION wq_filter_problem(p_filter jsonb)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $wq_filter_problem$
DECLARE
    v_clauses  jsonb;
    v_clause   jsonb;
    v_members  jsonb;
    v_member   jsonb;
    v_is_group boolean;
    v_path     text;  -- the clause: a condition or a group
    v_at       text;  -- the condition being checked (a group member has its own path)
    v_field    text COLLATE "C";
    v_group    text COLLATE "C";  -- the field of the group being checked
    v_operator text COLLATE "C";
    v_fields   text[] := '{}';
    v_values   integer := 0;
BEGIN
    IF p_filter IS NULL OR jsonb_typeof(p_filter) = 'null' THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(p_filter) <> 'object' THEN
        RETURN 'filter: must be a JSON object {"logic": "and", "filters": [...]}, got '
            || jsonb_typeof(p_filter);
    END IF;
    IF p_filter = '{}'::jsonb THEN
        RETURN NULL;
    END IF;
    -- Every statement below is a simple expression (no query), which PL/pgSQL evaluates
    -- without executor start-up: the matcher runs this on every publish.
    IF p_filter - ARRAY['logic', 'filters'] <> '{}'::jsonb THEN
        RETURN 'filter: unknown key (allowed keys: filters, logic)';
    END IF;
    IF NOT p_filter ? 'logic' THEN
        RETURN 'filter: missing ''logic''; the root must be {"logic": "and", "filters": [...]}';
    END IF;
    IF p_filter -> 'logic' <> '"and"'::jsonb THEN
        RETURN 'filter.logic: the root logic must be ''and''; to accept one of several values '
            || 'of a field, nest {"logic": "or", "filters": [...]} inside the root';
    END IF;
    v_clauses := p_filter -> 'filters';
    IF v_clauses IS NULL THEN
        RETURN 'filter: missing ''filters'' (a list of conditions)';
    END IF;
    IF jsonb_typeof(v_clauses) <> 'array' THEN
        RETURN 'filter.filters: must be a list, got ' || jsonb_typeof(v_clauses);
    END IF;

    FOR i IN 0 .. jsonb_array_length(v_clauses) - 1 LOOP
        v_clause := v_clauses -> i;
        v_path := 'filter.filters[' || i || ']';
        IF jsonb_typeof(v_clause) <> 'object' THEN
            RETURN v_path || ': must be an object (a condition or a group), got '
                || jsonb_typeof(v_clause);
        END IF;
        v_is_group := v_clause ? 'logic' OR v_clause ? 'filters';
        IF v_is_group THEN
            IF v_clause - ARRAY['logic', 'filters'] <> '{}'::jsonb THEN
                RETURN v_path || ': unknown key (allowed keys: filters, logic)';
            END IF;
            IF (v_clause -> 'logic') IS DISTINCT FROM '"or"'::jsonb THEN
                RETURN v_path || '.logic: a nested group must use logic ''or'' (conditions '
                    || 'combined with ''and'' belong directly in the root ''filters'' list)';
            END IF;
            v_members := v_clause -> 'filters';
            IF jsonb_typeof(v_members) IS DISTINCT FROM 'array' THEN
                RETURN v_path || '.filters: must be a list of ''eq'' conditions';
            END IF;
            IF jsonb_array_length(v_members) = 0 THEN
                RETURN v_path || '.filters: an ''or'' group needs at least one ''eq'' condition';
            END IF;
        ELSE
            -- A condition is checked as a group of one, under its own path.
            v_members := jsonb_build_array(v_clause);
        END IF;

        v_group := NULL;
        FOR j IN 0 .. jsonb_array_length(v_members) - 1 LOOP
            v_member := v_members -> j;
            v_at := v_path;
            IF v_is_group THEN
                v_at := v_path || '.filters[' || j || ']';
                IF jsonb_typeof(v_member) <> 'object' THEN
                    RETURN v_at || ': must be an ''eq'' condition object, got '
                        || jsonb_typeof(v_member);
                END IF;
                IF v_member ? 'logic' OR v_member ? 'filters' THEN
                    RETURN v_at || ': groups may be nested only one level deep; an ''or'' group '
                        || 'may contain only ''eq'' conditions';
                END IF;
            END IF;

            IF v_member - ARRAY['field', 'operator', 'value'] <> '{}'::jsonb THEN
                RETURN v_at || ': unknown key (allowed keys: field, operator, value)';
            END IF;
            IF NOT v_member ? 'field' THEN
                RETURN v_at || ': missing ''field'' (the attribute name to test)';
            END IF;
            IF jsonb_typeof(v_member -> 'field') <> 'string' THEN
                RETURN v_at || '.field: must be a string attribute name';
            END IF;
            v_field := v_member ->> 'field';
            IF v_field !~ '^[A-Za-z0-9_-]{1,64}$' THEN
                RETURN v_at || '.field: invalid attribute name ' || quote_literal(v_field)
                    || ': use 1-64 characters from A-Z, a-z, 0-9, ''_'' and ''-''';
            END IF;
            IF NOT v_member ? 'operator' THEN
                RETURN v_at || ': missing ''operator'' (one of ''eq'', ''neq'', ''startswith'', '
                    || '''isnull'', ''isnotnull'')';
            END IF;
            v_operator := CASE WHEN jsonb_typeof(v_member -> 'operator') = 'string'
                               THEN v_member ->> 'operator' END;
            IF v_operator IS NULL
               OR v_operator NOT IN ('eq', 'neq', 'startswith', 'isnull', 'isnotnull') THEN
                RETURN v_at || '.operator: unsupported operator (allowed: ''eq'', ''neq'', '
                    || '''startswith'', ''isnull'', ''isnotnull'')';
            END IF;
            IF v_operator IN ('isnull', 'isnotnull') THEN
                -- An explicit JSON null is what filter-builder UIs send; anything else is a value.
                IF jsonb_typeof(v_member -> 'value') <> 'null' THEN
                    RETURN v_at || '.value: operator ' || quote_literal(v_operator)
                        || ' takes no value';
                END IF;
            ELSIF (v_member ->> 'value') IS NULL THEN
                RETURN v_at || ': operator ' || quote_literal(v_operator)
                    || ' needs a non-empty string ''value''';
            ELSIF jsonb_typeof(v_member -> 'value') <> 'string' OR v_member ->> 'value' = '' THEN
                RETURN v_at || '.value: must be a non-empty string (values compare as strings)';
            END IF;

            IF v_is_group AND v_operator <> 'eq' THEN
                RETURN v_at || '.operator: only ''eq'' is allowed inside an ''or'' group (a group '
                    || 'means "field is one of these values")';
            END IF;
            IF v_is_group AND v_group IS NOT NULL THEN
                IF v_field <> v_group THEN
                    RETURN v_at || '.field: an ''or'' group must constrain a single field; this '
                        || 'group is about ' || quote_literal(v_group);
                END IF;
            ELSE
                -- A condition, or a group's first member: the field is claimed for the clause.
                IF v_field = ANY (v_fields) THEN
                    RETURN v_path || ': field ' || quote_literal(v_field) || ' is already '
                        || 'constrained; each field may be constrained only once (to accept '
                        || 'several values use one {"logic": "or", "filters": [...]} group)';
                END IF;
                IF cardinality(v_fields) >= 5 THEN
                    RETURN v_path || ': a filter may constrain at most 5 distinct fields';
                END IF;
                v_fields := v_fields || v_field;
                v_group := v_field;
            END IF;
            IF v_operator NOT IN ('isnull', 'isnotnull') THEN
                v_values := v_values + 1;
                IF v_values > 50 THEN
                    RETURN v_at || '.value: too many values; a filter may list at most 50 '
                        || 'values in total';
                END IF;
            END IF;
        END LOOP;
    END LOOP;

    RETURN NULL;
END
$wq_filter_problem$;

COMMENT ON FUNCTION wq_filter_problem(jsonb) IS
    'Why a stored attribute filter is invalid ("<path>: <problem>"), or NULL when it is valid. '
    'Mirrors workqueue.filters.stored_filter_problem.';

-- wq_filter_matches(p_filter jsonb, p_attributes jsonb) RETURNS boolean
--
-- Decides whether a published message (its attributes object) fans out to a subscription (its
-- stored attribute filter), exactly as workqueue.filters.stored_filter_matches does:
--   * NULL filter, JSON null, {} or an empty "filters" list -> true (matches all);
--   * a filter wq_filter_problem rejects -> false: an invalid filter (one written behind the
--     guard, or stored before it existed) costs its own subscription its deliveries, never the
--     publish or the topic's other subscriptions;
--   * otherwise the AND of the root clauses:
--       eq          attribute present and equal to value
--       neq         attribute present and different from value
--       startswith  attribute present and starting with value
--       isnull      attribute absent
--       isnotnull   attribute present
--       {"logic": "or", "filters": [eq...]}  attribute present and equal to one of the values
--   * NULL attributes (or JSON null) are treated as "no attributes"; "absent" means the key is
--     missing or its value is JSON null; an empty string is present;
--   * comparison is exact and case-sensitive (byte-wise, COLLATE "C"), whatever the database
--     collation, matching Python's code-point comparison of str.
-- The clauses are tried first, reading any JSON without failing, and the first clause that
-- fails answers false: right whether or not the filter is valid. Only a filter whose clauses all
-- pass pays for wq_filter_problem, so a publish checks the grammar of the subscriptions it
-- delivers to, not of every filtered subscription of the topic.
-- IMMUTABLE and PARALLEL SAFE: depends only on its arguments, touches no tables.
CREATE OR REPLACE FUNCTION wq_filter_matches(p_filter jsonb, p_attributes jsonb)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $wq_filter_matches$
DECLARE
    v_clauses  jsonb;
    v_clause   jsonb;
    v_members  jsonb;
    v_field    text;
    v_operator text;
    -- COLLATE "C" makes = and starts_with byte comparisons regardless of the database default.
    v_actual   text COLLATE "C";
    v_expected text COLLATE "C";
BEGIN
    IF p_filter IS NULL OR jsonb_typeof(p_filter) = 'null' THEN
        RETURN true;
    END IF;
    v_clauses := p_filter -> 'filters';

    -- Index-based loop rather than FOR ... IN SELECT jsonb_array_elements(): every statement
    -- below is a simple expression that PL/pgSQL evaluates without a cursor or executor
    -- start-up, which matters because this runs once per subscription on every publish. On a
    -- malformed node each one yields NULL rather than an error (-> and ->> on the wrong type,
    -- comparisons with NULL), and a NULL comparison lets the clause pass to the grammar check.
    IF jsonb_typeof(v_clauses) = 'array' THEN
        FOR i IN 0 .. jsonb_array_length(v_clauses) - 1 LOOP
            v_clause := v_clauses -> i;
            v_members := v_clause -> 'filters';

            IF v_members IS NOT NULL THEN
                -- An "or" group of eq conditions on one field: present and equal to a member.
                v_field := v_members -> 0 ->> 'field';
                v_actual := p_attributes ->> v_field;
                -- jsonb containment compares JSON strings exactly, so this is "v_actual is one
                -- of the member values" in a single operator call instead of a per-member loop.
                IF v_actual IS NULL
                   OR NOT v_members @> jsonb_build_array(
                           jsonb_build_object('field', v_field, 'value', v_actual)) THEN
                    RETURN false;
                END IF;
                CONTINUE;
            END IF;

            v_operator := v_clause ->> 'operator';
            -- ->> yields NULL both for a missing key and for a JSON null value: both "absent".
            v_actual := p_attributes ->> (v_clause ->> 'field');
            v_expected := v_clause ->> 'value';

            IF v_operator = 'isnull' THEN
                IF v_actual IS NOT NULL THEN
                    RETURN false;
                END IF;
            ELSIF v_actual IS NULL THEN
                RETURN false;  -- a missing attribute fails every other operator, neq included
            ELSIF v_operator = 'eq' THEN
                IF v_actual <> v_expected THEN
                    RETURN false;
                END IF;
            ELSIF v_operator = 'neq' THEN
                IF v_actual = v_expected THEN
                    RETURN false;
                END IF;
            ELSIF v_operator = 'startswith' THEN
                IF NOT starts_with(v_actual, v_expected) THEN
                    RETURN false;
                END IF;
            END IF;  -- isnotnull: present, satisfied
        END LOOP;
    END IF;

    RETURN wq_filter_problem(p_filter) IS NULL;
END
$wq_filter_matches$;

COMMENT ON FUNCTION wq_filter_matches(jsonb, jsonb) IS
    'True when a message''s attributes satisfy a subscription''s attribute filter (NULL/empty '
    'filter matches all, an invalid one matches none). Mirrors '
    'workqueue.filters.stored_filter_matches.';

-- wq_sub_filter_valid --
-- The guard: no row of workqueue_subscription may hold a filter wq_filter_problem rejects,
-- whoever writes it (the ORM validates first and names the problem; this catches raw SQL).
-- NOT VALID: rows written before the guard existed are not re-checked, so installing never
-- fails on old data; such a row matches nothing and `manage.py workqueue validate-bindings`
-- reports it until it is fixed. Every later INSERT and UPDATE is checked.
-- Added only when missing, told by its name: a guard whose expression changes must take a new
-- name (and drop the old one here), or upgraded databases would keep the old expression.
DO $filter_guard$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint c
         WHERE c.conrelid = 'workqueue_subscription'::regclass
           AND c.conname = 'wq_sub_filter_valid'
    ) THEN
        ALTER TABLE workqueue_subscription
            ADD CONSTRAINT wq_sub_filter_valid CHECK (wq_filter_problem(filter) IS NULL) NOT VALID;
    END IF;
END
$filter_guard$;
