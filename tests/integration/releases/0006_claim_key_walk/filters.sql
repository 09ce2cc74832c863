-- wq_filter_matches(p_filter jsonb, p_attributes jsonb) RETURNS boolean
--
-- Decides whether a published message (its attributes object) fans out to a subscription
-- (its stored attribute filter). This is the SQL twin of AttributeFilter.matches() in
-- workqueue/filters.py and must stay semantically identical to it; the parity test
-- tests/driver/test_filter_sql_parity.py checks that on generated cases.
--
-- Guarantees, for a filter accepted by workqueue.filters.parse_filter (canonical or as written):
--   * NULL filter, JSON null, {} or an empty or missing "filters" list -> true (matches all).
--   * NULL attributes (or JSON null) are treated as "no attributes".
--   * The result is the AND of the root clauses:
--       eq          attribute present and equal to value
--       neq         attribute present and different from value
--       startswith  attribute present and starting with value
--       isnull      attribute absent
--       isnotnull   attribute present
--       {"logic": "or", "filters": [eq...]}  attribute present and equal to one of the values
--   * "Absent" means the key is missing or its value is JSON null; an empty string is present.
--   * Comparison is exact and case-sensitive (byte-wise, COLLATE "C"), whatever the database
--     collation, matching Python's code-point comparison of str.
--   * Evaluation stops at the first failing clause.
--   * Input it cannot interpret raises SQLSTATE 22023 (invalid_parameter_value) instead of
--     quietly returning a guess, because a corrupt stored filter must surface rather than
--     silently drop or misroute deliveries: a filter that is not an object, "filters" that is
--     not an array, an "or" group without a first member naming a field, and (when evaluation
--     reaches it) a clause with an operator outside the grammar or eq/neq/startswith without a
--     value.
--   * IMMUTABLE and PARALLEL SAFE: depends only on its arguments, touches no tables.
--
-- The function does not re-validate the grammar (field names, limits, group shape); that is
-- done once when the subscription is saved. Idempotent: safe to run repeatedly.

CREATE OR REPLACE FUNCTION wq_filter_matches(p_filter jsonb, p_attributes jsonb)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $wq_filter_matches$
DECLARE
    v_clauses  jsonb;
    v_count    integer;
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
    IF jsonb_typeof(p_filter) <> 'object' THEN
        RAISE EXCEPTION 'wq_filter_matches: filter must be a JSON object, got %',
            jsonb_typeof(p_filter)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_clauses := p_filter -> 'filters';
    IF v_clauses IS NULL THEN
        RETURN true;  -- {} and {"logic": "and"}: no conditions
    END IF;
    IF jsonb_typeof(v_clauses) <> 'array' THEN
        RAISE EXCEPTION 'wq_filter_matches: "filters" must be a JSON array, got %',
            jsonb_typeof(v_clauses)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_count := jsonb_array_length(v_clauses);

    -- Index-based loop rather than FOR ... IN SELECT jsonb_array_elements(): every statement
    -- below is a simple expression that PL/pgSQL evaluates without a cursor or executor
    -- start-up, which matters because this runs once per subscription on every publish.
    FOR i IN 0 .. v_count - 1 LOOP
        v_clause := v_clauses -> i;
        v_members := v_clause -> 'filters';

        IF v_members IS NOT NULL THEN
            -- An "or" group of eq conditions on one field: present and equal to some member.
            -- All members name the same field (validated on save), so read it from the first.
            v_field := v_members -> 0 ->> 'field';
            IF v_field IS NULL THEN
                RAISE EXCEPTION 'wq_filter_matches: "or" group % has no member naming a field', i
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            v_actual := p_attributes ->> v_field;
            -- jsonb containment compares JSON strings exactly, so this is "v_actual is one of
            -- the member values" in a single operator call instead of a per-member loop.
            IF v_actual IS NULL
               OR NOT v_members @> jsonb_build_array(
                       jsonb_build_object('field', v_field, 'value', v_actual)) THEN
                RETURN false;
            END IF;
            CONTINUE;
        END IF;

        v_operator := v_clause ->> 'operator';
        -- ->> yields NULL both for a missing key and for a JSON null value: both are "absent".
        v_actual := p_attributes ->> (v_clause ->> 'field');

        IF v_operator = 'isnull' THEN
            IF v_actual IS NOT NULL THEN
                RETURN false;
            END IF;
        ELSIF v_actual IS NULL THEN
            -- A missing attribute fails every operator except isnull (neq included), but an
            -- unknown operator must still be reported rather than masked by the absence.
            IF v_operator NOT IN ('eq', 'neq', 'startswith', 'isnotnull')
               OR v_operator IS NULL THEN
                RAISE EXCEPTION 'wq_filter_matches: unsupported filter operator %', v_operator
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            RETURN false;
        ELSIF v_operator = 'isnotnull' THEN
            NULL;  -- present: satisfied
        ELSE
            v_expected := v_clause ->> 'value';
            IF v_expected IS NULL THEN
                -- Without this, NULL comparisons would make a value-less eq/neq silently pass.
                RAISE EXCEPTION 'wq_filter_matches: operator % has no value', v_operator
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            IF v_operator = 'eq' THEN
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
            ELSE
                RAISE EXCEPTION 'wq_filter_matches: unsupported filter operator %', v_operator
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
        END IF;
    END LOOP;

    RETURN true;
END
$wq_filter_matches$;

COMMENT ON FUNCTION wq_filter_matches(jsonb, jsonb) IS
    'True when a message''s attributes satisfy a subscription''s validated attribute filter '
    '(NULL/empty filter matches all). Mirrors workqueue.filters.AttributeFilter.matches.';
