-- Attribute filters: the T-SQL twin of workqueue/sql/postgresql/filters.sql. The grammar check
-- (wq_filter_problem), the matcher the fan-out runs (wq_filter_matches) and the guard that keeps
-- invalid filters out of workqueue_subscription (the CHECK constraint wq_sub_filter_valid) decide
-- exactly as workqueue.filters.stored_filter_problem and stored_filter_matches do, for valid and
-- invalid filters alike.
--
-- File conventions for every workqueue/sql/sqlserver/*.sql file (checked by
-- tests/driver/test_parity.py and tests/driver/test_tsql_parses.py):
--   * one object per batch, batches separated by lines holding only GO;
--   * each routine is created with CREATE OR ALTER and preceded by a comment header naming it and
--     saying what it guarantees; a procedure that returns rows lists its result columns on a
--     "-- returns: a, b, c" line of that header, and the one statement that produces the result
--     set is preceded by a line holding only "-- result set";
--   * SYSDATETIMEOFFSET() is the only clock; no dynamic SQL; no percent sign followed by "s"
--     anywhere, comments included (mssql-django rewrites it in batches that contain GROUP BY).
--
-- Storage notes shared by all files: Django keeps UUIDField values in char(32) columns (lower-case
-- hex, no dashes) on SQL Server, JSONField values in nvarchar(max) as text, and partition and
-- deduplication keys in nvarchar(200) COLLATE Latin1_General_100_BIN2. Procedures take and return
-- uniqueidentifier values and convert at the edge with dbo.wq_uuid_text / dbo.wq_text_uuid
-- (publish.sql).
--
-- JSON text is compared exactly here: under Latin1_General_100_BIN2 (case- and accent-sensitive,
-- code unit order) and, because "=" ignores trailing spaces in every collation, either with equal
-- DATALENGTHs or with a sentinel appended ("key + N'|' IN (N'logic|', ...)").

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_sub_filter_valid (dropped) --
-- SQL Server refuses to alter a function that a CHECK constraint uses, so the guard is dropped
-- before wq_filter_problem is (re)created and added again at the end of this file.
IF OBJECT_ID(N'dbo.wq_sub_filter_valid', N'C') IS NOT NULL
    ALTER TABLE dbo.workqueue_subscription DROP CONSTRAINT wq_sub_filter_valid;
GO

-- wq_filter_problem --
-- Why a stored filter (JSON text) is invalid, as "<path>: <problem>" naming the part at fault the
-- way workqueue.filters.FilterError does (e.g. "filter.filters[1].operator: ..."), or NULL when it
-- is valid: NULL, JSON null, {} and an empty "filters" list (no filter), or an object that
-- follows the grammar of workqueue/filters.py, checked in the same order as
-- workqueue.filters.parse_filter and the PostgreSQL wq_filter_problem (see there for the grammar).
-- One difference of representation: this column holds text, which may repeat a key; PostgreSQL
-- and Python keep only the last of repeated keys, so such text is refused here rather than read
-- differently. Reads no tables.
CREATE OR ALTER FUNCTION dbo.wq_filter_problem(@filter nvarchar(max))
RETURNS nvarchar(4000)
AS
BEGIN
    DECLARE @text nvarchar(max);
    DECLARE @item nvarchar(max);
    DECLARE @item_type int;
    DECLARE @clauses nvarchar(max);
    DECLARE @clause nvarchar(max);
    DECLARE @members nvarchar(max);
    DECLARE @member nvarchar(max);
    DECLARE @is_group bit;
    DECLARE @path nvarchar(100);
    DECLARE @at nvarchar(200);
    DECLARE @field nvarchar(max);
    DECLARE @group_field nvarchar(64);
    DECLARE @operator nvarchar(max);
    DECLARE @value nvarchar(max);
    DECLARE @value_type int;
    DECLARE @clause_count int;
    DECLARE @member_count int;
    DECLARE @i int = 0;
    DECLARE @j int;
    DECLARE @values int = 0;
    DECLARE @fields TABLE (field nvarchar(64) NOT NULL);

    IF @filter IS NULL
        RETURN NULL;
    -- JSON whitespace is space, tab, line feed and carriage return.
    SET @text = LTRIM(RTRIM(REPLACE(REPLACE(REPLACE(@filter, NCHAR(9), N' '), NCHAR(10), N' '),
                                    NCHAR(13), N' ')));
    IF @text COLLATE Latin1_General_100_BIN2 = N'null'
        RETURN NULL;
    -- ISJSON is 1 for an object or an array only.
    IF ISJSON(@filter) = 0 OR LEFT(@text, 1) <> N'{'
        RETURN N'filter: must be a JSON object {"logic": "and", "filters": [...]}';
    IF NOT EXISTS (SELECT 1 FROM OPENJSON(@filter))
        RETURN NULL;
    IF EXISTS (SELECT 1 FROM OPENJSON(@filter) AS k
                WHERE k.[key] + N'|' NOT IN (N'logic|', N'filters|'))
        RETURN N'filter: unknown key (allowed keys: filters, logic)';
    IF EXISTS (SELECT 1 FROM OPENJSON(@filter) AS k GROUP BY k.[key] HAVING COUNT(*) > 1)
        RETURN N'filter: a key is repeated';

    SET @item_type = NULL;
    SELECT @item = k.[value], @item_type = k.[type] FROM OPENJSON(@filter) AS k
     WHERE k.[key] = N'logic';
    IF @item_type IS NULL
        RETURN N'filter: missing ''logic''; the root must be {"logic": "and", "filters": [...]}';
    IF @item_type <> 1 OR @item COLLATE Latin1_General_100_BIN2 + N'|' <> N'and|'
        RETURN N'filter.logic: the root logic must be ''and''; to accept one of several values '
            + N'of a field, nest {"logic": "or", "filters": [...]} inside the root';
    SET @item_type = NULL;
    SELECT @clauses = k.[value], @item_type = k.[type] FROM OPENJSON(@filter) AS k
     WHERE k.[key] = N'filters';
    IF @item_type IS NULL
        RETURN N'filter: missing ''filters'' (a list of conditions)';
    IF @item_type <> 4
        RETURN N'filter.filters: must be a list';

    SELECT @clause_count = COUNT(*) FROM OPENJSON(@clauses);
    WHILE @i < @clause_count
    BEGIN
        SET @path = N'filter.filters[' + CAST(@i AS nvarchar(10)) + N']';
        SET @item_type = NULL;
        SELECT @clause = c.[value], @item_type = c.[type] FROM OPENJSON(@clauses) AS c
         WHERE c.[key] = CAST(@i AS nvarchar(10));
        SET @i += 1;
        IF @item_type <> 5
            RETURN @path + N': must be an object (a condition or a group)';
        IF EXISTS (SELECT 1 FROM OPENJSON(@clause) AS k GROUP BY k.[key] HAVING COUNT(*) > 1)
            RETURN @path + N': a key is repeated';
        SET @is_group = CASE WHEN EXISTS (SELECT 1 FROM OPENJSON(@clause) AS k
                                           WHERE k.[key] + N'|' IN (N'logic|', N'filters|'))
                             THEN 1 ELSE 0 END;
        IF @is_group = 1
        BEGIN
            IF EXISTS (SELECT 1 FROM OPENJSON(@clause) AS k
                        WHERE k.[key] + N'|' NOT IN (N'logic|', N'filters|'))
                RETURN @path + N': unknown key (allowed keys: filters, logic)';
            SET @item = NULL;
            SET @item_type = NULL;
            SELECT @item = k.[value], @item_type = k.[type] FROM OPENJSON(@clause) AS k
             WHERE k.[key] = N'logic';
            IF @item_type IS NULL OR @item_type <> 1
               OR @item COLLATE Latin1_General_100_BIN2 + N'|' <> N'or|'
                RETURN @path + N'.logic: a nested group must use logic ''or'' (conditions '
                    + N'combined with ''and'' belong directly in the root ''filters'' list)';
            SET @members = NULL;
            SET @item_type = NULL;
            SELECT @members = k.[value], @item_type = k.[type] FROM OPENJSON(@clause) AS k
             WHERE k.[key] = N'filters';
            IF @item_type IS NULL OR @item_type <> 4
                RETURN @path + N'.filters: must be a list of ''eq'' conditions';
            SELECT @member_count = COUNT(*) FROM OPENJSON(@members);
            IF @member_count = 0
                RETURN @path + N'.filters: an ''or'' group needs at least one ''eq'' condition';
        END
        ELSE
        BEGIN
            -- A condition is checked as a group of one, under its own path.
            SET @members = N'[' + @clause + N']';
            SET @member_count = 1;
        END;

        SET @group_field = NULL;
        SET @j = 0;
        WHILE @j < @member_count
        BEGIN
            SET @item_type = NULL;
            SELECT @member = m.[value], @item_type = m.[type] FROM OPENJSON(@members) AS m
             WHERE m.[key] = CAST(@j AS nvarchar(10));
            SET @at = CASE WHEN @is_group = 1
                           THEN @path + N'.filters[' + CAST(@j AS nvarchar(10)) + N']'
                           ELSE @path END;
            SET @j += 1;
            IF @is_group = 1
            BEGIN
                IF @item_type <> 5
                    RETURN @at + N': must be an ''eq'' condition object';
                IF EXISTS (SELECT 1 FROM OPENJSON(@member) AS k
                            GROUP BY k.[key] HAVING COUNT(*) > 1)
                    RETURN @at + N': a key is repeated';
                IF EXISTS (SELECT 1 FROM OPENJSON(@member) AS k
                            WHERE k.[key] + N'|' IN (N'logic|', N'filters|'))
                    RETURN @at + N': groups may be nested only one level deep; an ''or'' group '
                        + N'may contain only ''eq'' conditions';
            END;

            IF EXISTS (SELECT 1 FROM OPENJSON(@member) AS k
                        WHERE k.[key] + N'|' NOT IN (N'field|', N'operator|', N'value|'))
                RETURN @at + N': unknown key (allowed keys: field, operator, value)';
            SET @field = NULL;
            SET @item_type = NULL;
            SELECT @field = k.[value], @item_type = k.[type] FROM OPENJSON(@member) AS k
             WHERE k.[key] = N'field';
            IF @item_type IS NULL
                RETURN @at + N': missing ''field'' (the attribute name to test)';
            IF @item_type <> 1
                RETURN @at + N'.field: must be a string attribute name';
            -- 1 to 64 characters from A-Z, a-z, 0-9, '_' and '-' (in brackets '_' is literal and
            -- a final '-' too; ranges follow code points under a binary collation).
            IF DATALENGTH(@field) NOT BETWEEN 2 AND 128
               OR @field COLLATE Latin1_General_100_BIN2 LIKE N'%[^A-Za-z0-9_-]%'
                RETURN @at + N'.field: invalid attribute name: use 1-64 characters from A-Z, '
                    + N'a-z, 0-9, ''_'' and ''-''';
            SET @operator = NULL;
            SET @item_type = NULL;
            SELECT @operator = k.[value], @item_type = k.[type] FROM OPENJSON(@member) AS k
             WHERE k.[key] = N'operator';
            IF @item_type IS NULL
                RETURN @at + N': missing ''operator'' (one of ''eq'', ''neq'', ''startswith'', '
                    + N'''isnull'', ''isnotnull'')';
            IF @item_type <> 1
               OR @operator COLLATE Latin1_General_100_BIN2 + N'|'
                  NOT IN (N'eq|', N'neq|', N'startswith|', N'isnull|', N'isnotnull|')
                RETURN @at + N'.operator: unsupported operator (allowed: ''eq'', ''neq'', '
                    + N'''startswith'', ''isnull'', ''isnotnull'')';
            SET @value = NULL;
            SET @value_type = NULL;
            SELECT @value = k.[value], @value_type = k.[type] FROM OPENJSON(@member) AS k
             WHERE k.[key] = N'value';
            IF @operator IN (N'isnull', N'isnotnull')
            BEGIN
                -- An explicit JSON null (type 0) is what filter-builder UIs send.
                IF @value_type <> 0
                    RETURN @at + N'.value: operator ''' + @operator + N''' takes no value';
            END
            ELSE IF @value_type IS NULL OR @value_type = 0
                RETURN @at + N': operator ''' + @operator
                    + N''' needs a non-empty string ''value''';
            ELSE IF @value_type <> 1 OR DATALENGTH(@value) = 0
                RETURN @at + N'.value: must be a non-empty string (values compare as strings)';

            IF @is_group = 1 AND @operator <> N'eq'
                RETURN @at + N'.operator: only ''eq'' is allowed inside an ''or'' group (a group '
                    + N'means "field is one of these values")';
            IF @is_group = 1 AND @group_field IS NOT NULL
            BEGIN
                IF NOT (@field COLLATE Latin1_General_100_BIN2 = @group_field
                        AND DATALENGTH(@field) = DATALENGTH(@group_field))
                    RETURN @at + N'.field: an ''or'' group must constrain a single field; this '
                        + N'group is about ''' + @group_field + N'''';
            END
            ELSE
            BEGIN
                -- A condition, or a group's first member: the field is claimed for the clause.
                IF EXISTS (SELECT 1 FROM @fields AS f
                            WHERE f.field COLLATE Latin1_General_100_BIN2 = @field
                              AND DATALENGTH(f.field) = DATALENGTH(@field))
                    RETURN @path + N': field ''' + @field + N''' is already constrained; each '
                        + N'field may be constrained only once (to accept several values use '
                        + N'one {"logic": "or", "filters": [...]} group)';
                IF (SELECT COUNT(*) FROM @fields) >= 5
                    RETURN @path + N': a filter may constrain at most 5 distinct fields';
                INSERT INTO @fields (field) VALUES (@field);
                SET @group_field = @field;
            END;
            IF @operator NOT IN (N'isnull', N'isnotnull')
            BEGIN
                SET @values += 1;
                IF @values > 50
                    RETURN @at + N'.value: too many values; a filter may list at most 50 values '
                        + N'in total';
            END;
        END;
    END;

    RETURN NULL;
END;
GO

-- wq_filter_matches --
-- Decides whether a message's attributes (a JSON object of strings, or NULL) satisfy a
-- subscription's stored attribute filter, exactly as workqueue.filters.stored_filter_matches and
-- the PostgreSQL wq_filter_matches do:
--   * NULL filter, JSON null, {} or an empty "filters" list matches;
--   * a filter wq_filter_problem rejects matches nothing: an invalid filter (one written behind
--     the guard, or stored before it existed) costs its own subscription its deliveries, never
--     the publish or the topic's other subscriptions;
--   * otherwise the root clauses are ANDed:
--       eq / neq / startswith  attribute present and equal / different / prefixed by the value
--       isnull / isnotnull     attribute absent / present
--       {"logic":"or","filters":[eq...]}  attribute present and equal to one of the values;
--   * "absent" means a missing key or a JSON null; an empty string is present;
--   * comparisons are exact: binary collation (case- and accent-sensitive) and equal lengths, so
--     SQL Server's trailing-space padding rule cannot make 'x' equal 'x '.
-- The clauses are tried first, opening only JSON objects and arrays (OPENJSON fails on anything
-- else) and skipping what is malformed, and the first clause that fails answers 0: right whether
-- or not the filter is valid. Only a filter whose clauses all pass pays for wq_filter_problem,
-- so a publish checks the grammar of the subscriptions it delivers to, not of every filtered
-- subscription of the topic. Reads no tables.
CREATE OR ALTER FUNCTION dbo.wq_filter_matches(@filter nvarchar(max), @attributes nvarchar(max))
RETURNS bit
AS
BEGIN
    DECLARE @clauses nvarchar(max);
    DECLARE @clauses_type int;
    DECLARE @clause nvarchar(max);
    DECLARE @clause_type int;
    DECLARE @members nvarchar(max);
    DECLARE @members_type int;
    DECLARE @field nvarchar(max);
    DECLARE @operator nvarchar(max);
    DECLARE @actual nvarchar(max);
    DECLARE @expected nvarchar(max);
    DECLARE @count int;
    DECLARE @i int = 0;

    IF @filter IS NULL
        RETURN 1;

    -- ISJSON is 1 for an object or an array only; other text has no clauses to try.
    IF ISJSON(@filter) = 1
        SELECT @clauses = f.[value], @clauses_type = f.[type]
          FROM OPENJSON(@filter) AS f
         WHERE f.[key] = N'filters';
    IF @clauses_type = 4
        SELECT @count = COUNT(*) FROM OPENJSON(@clauses);

    WHILE @i < @count
    BEGIN
        SET @clause_type = NULL;
        SELECT @clause = c.[value], @clause_type = c.[type]
          FROM OPENJSON(@clauses) AS c
         WHERE c.[key] = CAST(@i AS nvarchar(10));
        SET @i += 1;
        IF @clause_type IS NULL OR @clause_type <> 5
            CONTINUE;

        SET @members_type = NULL;
        SELECT @members = m.[value], @members_type = m.[type]
          FROM OPENJSON(@clause) AS m
         WHERE m.[key] = N'filters';

        IF @members_type IS NOT NULL
        BEGIN
            IF @members_type <> 4
                CONTINUE;
            -- An "or" group of eq conditions on one field: the attribute must equal one member's
            -- value.
            SET @field = JSON_VALUE(@members, N'$[0].field');
            SET @actual = NULL;
            SELECT @actual = a.[value]
              FROM OPENJSON(@attributes) AS a
             WHERE a.[key] = @field AND DATALENGTH(a.[key]) = DATALENGTH(@field) AND a.[type] <> 0;
            IF @actual IS NULL
               OR NOT EXISTS (
                   SELECT 1
                     FROM OPENJSON(@members) WITH (value nvarchar(max) '$.value') AS g
                    WHERE g.value COLLATE Latin1_General_100_BIN2 = @actual
                      AND DATALENGTH(g.value) = DATALENGTH(@actual))
                RETURN 0;
            CONTINUE;
        END;

        SET @field = NULL;
        SET @operator = NULL;
        SET @expected = NULL;
        SELECT @field = w.field, @operator = w.operator, @expected = w.value
          FROM OPENJSON(@clause)
               WITH (field nvarchar(max) '$.field',
                     operator nvarchar(max) '$.operator',
                     value nvarchar(max) '$.value') AS w;
        -- A missing key and a JSON null are both "absent" (type 0 is null). Attribute names
        -- are looked up exactly: OPENJSON's key column has a binary collation.
        SET @actual = NULL;
        SELECT @actual = a.[value]
          FROM OPENJSON(@attributes) AS a
         WHERE a.[key] = @field AND DATALENGTH(a.[key]) = DATALENGTH(@field) AND a.[type] <> 0;

        IF @operator = N'isnull'
        BEGIN
            IF @actual IS NOT NULL
                RETURN 0;
        END
        ELSE IF @actual IS NULL
            RETURN 0;  -- a missing attribute fails every other operator, neq included
        ELSE IF @operator = N'eq'
        BEGIN
            IF NOT (@actual COLLATE Latin1_General_100_BIN2 = @expected
                    AND DATALENGTH(@actual) = DATALENGTH(@expected))
                RETURN 0;
        END
        ELSE IF @operator = N'neq'
        BEGIN
            IF @actual COLLATE Latin1_General_100_BIN2 = @expected
               AND DATALENGTH(@actual) = DATALENGTH(@expected)
                RETURN 0;
        END
        ELSE IF @operator = N'startswith'
        BEGIN
            -- Compare the first DATALENGTH/2 UTF-16 code units: a binary collation counts
            -- code units, and equal lengths make the comparison exact.
            IF NOT (DATALENGTH(@actual) >= DATALENGTH(@expected)
                    AND SUBSTRING(@actual COLLATE Latin1_General_100_BIN2, 1, DATALENGTH(@expected) / 2) = @expected)
                RETURN 0;
        END;
        -- isnotnull: present, satisfied
    END;

    IF dbo.wq_filter_problem(@filter) IS NOT NULL
        RETURN 0;
    RETURN 1;
END;
GO

-- wq_sub_filter_valid --
-- The guard: no row of workqueue_subscription may hold a filter wq_filter_problem rejects,
-- whoever writes it (the ORM validates first and names the problem; this catches raw SQL).
-- WITH NOCHECK: rows written before the guard existed are not re-checked, so installing never
-- fails on old data; such a row matches nothing and `manage.py workqueue validate-bindings`
-- reports it until it is fixed. Every later INSERT and UPDATE is checked.
ALTER TABLE dbo.workqueue_subscription WITH NOCHECK
    ADD CONSTRAINT wq_sub_filter_valid CHECK (dbo.wq_filter_problem([filter]) IS NULL);
GO
