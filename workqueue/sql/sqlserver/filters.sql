-- Attribute filters: the T-SQL twin of workqueue/sql/postgresql/filters.sql.
--
-- File conventions for every workqueue/sql/sqlserver/*.sql file (checked by
-- tests/driver/test_parity.py and tests/driver/test_tsql_parses.py):
--   * one object per batch, batches separated by lines holding only GO;
--   * each object is created with CREATE OR ALTER and preceded by a comment header naming it and
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

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_filter_matches --
-- Decides whether a message's attributes (a JSON object of strings, or NULL) satisfy a
-- subscription's stored attribute filter, exactly as workqueue.filters.AttributeFilter.matches
-- and the PostgreSQL wq_filter_matches do:
--   * NULL filter, a filter that is not a JSON object, or one without a "filters" array matches;
--   * the root clauses are ANDed and evaluated in order, stopping at the first that fails:
--       eq / neq / startswith  attribute present and equal / different / prefixed by the value
--       isnull / isnotnull     attribute absent / present
--       {"logic":"or","filters":[eq...]}  attribute present and equal to one of the values;
--   * "absent" means a missing key or a JSON null; an empty string is present;
--   * comparisons are exact: binary collation (case- and accent-sensitive) and equal lengths, so
--     SQL Server's trailing-space padding rule cannot make 'x' equal 'x ';
--   * an unknown operator, or eq/neq/startswith without a value, raises a conversion error whose
--     message names the problem (a function cannot THROW): a corrupt stored filter surfaces
--     instead of silently misrouting deliveries.
-- Reads no tables. Grammar limits (field names, group shape, counts) are checked when the
-- subscription is saved, not here.
CREATE OR ALTER FUNCTION dbo.wq_filter_matches(@filter nvarchar(max), @attributes nvarchar(max))
RETURNS bit
AS
BEGIN
    DECLARE @clauses nvarchar(max);
    DECLARE @clause nvarchar(max);
    DECLARE @members nvarchar(max);
    DECLARE @field nvarchar(4000);
    DECLARE @operator nvarchar(4000);
    DECLARE @actual nvarchar(max);
    DECLARE @expected nvarchar(max);
    DECLARE @count int;
    DECLARE @i int = 0;

    IF @filter IS NULL OR ISJSON(@filter) = 0 OR LEFT(LTRIM(@filter), 1) <> N'{'
        RETURN 1;

    SELECT @clauses = f.[value]
      FROM OPENJSON(@filter) AS f
     WHERE f.[key] = N'filters' AND f.[type] = 4;
    IF @clauses IS NULL
        RETURN 1;

    SELECT @count = COUNT(*) FROM OPENJSON(@clauses);

    WHILE @i < @count
    BEGIN
        SET @clause = NULL;
        SET @members = NULL;
        SELECT @clause = c.[value]
          FROM OPENJSON(@clauses) AS c
         WHERE c.[key] = CAST(@i AS nvarchar(10)) AND c.[type] = 5;
        SET @i += 1;

        IF @clause IS NULL
            RETURN CAST(N'wq_filter_matches: filter clause is not an object' AS int);

        SELECT @members = m.[value]
          FROM OPENJSON(@clause) AS m
         WHERE m.[key] = N'filters' AND m.[type] IN (4, 5);

        IF @members IS NOT NULL
        BEGIN
            -- An "or" group of eq conditions on one field (validated on save): the field is read
            -- from the first member, and the attribute must equal one member's value.
            SET @field = JSON_VALUE(@members, N'$[0].field');
            SET @actual = NULL;
            SELECT @actual = a.[value]
              FROM OPENJSON(@attributes) AS a
             WHERE a.[key] = @field AND DATALENGTH(a.[key]) = DATALENGTH(@field) AND a.[type] <> 0;
            IF @actual IS NULL
               OR NOT EXISTS (
                   SELECT 1
                     FROM OPENJSON(@members)
                          WITH (field nvarchar(4000) '$.field', value nvarchar(max) '$.value') AS g
                    WHERE g.field COLLATE Latin1_General_100_BIN2 = @field
                      AND DATALENGTH(g.field) = DATALENGTH(@field)
                      AND g.value COLLATE Latin1_General_100_BIN2 = @actual
                      AND DATALENGTH(g.value) = DATALENGTH(@actual))
                RETURN 0;
            CONTINUE;
        END;

        SET @field = NULL;
        SET @operator = NULL;
        SET @expected = NULL;
        SELECT @field = w.field, @operator = w.operator, @expected = w.value
          FROM OPENJSON(@clause)
               WITH (field nvarchar(4000) '$.field',
                     operator nvarchar(4000) '$.operator',
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
        BEGIN
            -- A missing attribute fails every operator except isnull, but an unknown operator
            -- is still reported rather than hidden by the absence.
            IF @operator IS NULL OR @operator NOT IN (N'eq', N'neq', N'startswith', N'isnotnull')
                RETURN CAST(N'wq_filter_matches: unsupported filter operator ' + COALESCE(@operator, N'(none)') AS int);
            RETURN 0;
        END
        ELSE IF @operator = N'isnotnull'
        BEGIN
            CONTINUE;
        END
        ELSE
        BEGIN
            IF @expected IS NULL
                RETURN CAST(N'wq_filter_matches: operator ' + COALESCE(@operator, N'(none)') + N' has no value' AS int);
            IF @operator = N'eq'
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
            END
            ELSE
                RETURN CAST(N'wq_filter_matches: unsupported filter operator ' + COALESCE(@operator, N'(none)') AS int);
        END;
    END;

    RETURN 1;
END;
GO
