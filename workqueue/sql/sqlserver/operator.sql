-- Operator reads and actions. Reads are bounded (keyset pages, capped counts) and return one
-- result set; actions are single guarded UPDATEs whose affected_rows says whether they took
-- effect. The acting user's name and the note are recorded on the delivery.

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_queue_gauges --
-- What a metrics scrape reads for one subscription, at a cost bounded whatever the backlog:
-- Pending, InFlight and DeadLettered deliveries and Ordered keys blocked by a dead-lettered head
-- (NULL for other modes), each counted up to @cap (clamped to 1..1000000; NULL: 10000), and the
-- age in whole seconds of the oldest Pending delivery (never negative; NULL when none), read
-- from the first entry of each priority in each claim index. No row when the subscription does
-- not exist.
-- returns: pending, in_flight, dead_lettered, blocked_keys, oldest_pending_age_seconds
CREATE OR ALTER PROCEDURE dbo.wq_queue_gauges
    @subscription_id uniqueidentifier,
    @cap int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    -- At most 2 s for a lock (a table being altered or rebuilt offline), then error 1222:
    -- a scrape answers without the gauges rather than wait as long as the lock is held.
    SET LOCK_TIMEOUT 2000;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @limit int = CASE WHEN @cap IS NULL THEN 10000 WHEN @cap < 1 THEN 1
                              WHEN @cap > 1000000 THEN 1000000 ELSE @cap END;
    DECLARE @oldest datetimeoffset(7);
    DECLARE @first datetimeoffset(7);
    DECLARE @keyed int = 0;  -- int, not bit: a bit never counts past 1 and the loop never ends
    DECLARE @level int;
    -- The oldest first entry of each priority present in each claim index (keyless, then
    -- keyed), the priorities found one probe at a time.
    WHILE @keyed <= 1
    BEGIN
        SET @level = dbo.wq_next_priority(@subscription_key, CAST(@keyed AS bit), 101);
        WHILE @level IS NOT NULL
        BEGIN
            IF @keyed = 1
                SET @first = (SELECT TOP (1) d.visible_at FROM dbo.workqueue_delivery AS d
                               WHERE d.subscription_id = @subscription_key
                                 AND d.status = N'Pending' AND d.partition_key IS NOT NULL
                                 AND d.priority = @level
                               ORDER BY d.visible_at);
            ELSE
                SET @first = (SELECT TOP (1) d.visible_at FROM dbo.workqueue_delivery AS d
                               WHERE d.subscription_id = @subscription_key
                                 AND d.status = N'Pending' AND d.partition_key IS NULL
                                 AND d.priority = @level
                               ORDER BY d.visible_at);
            IF @oldest IS NULL OR @first < @oldest
                SET @oldest = @first;
            SET @level = dbo.wq_next_priority(@subscription_key, CAST(@keyed AS bit), @level);
        END;
        SET @keyed = @keyed + 1;
    END;

    -- Each count is ordered as its index is, so the optimizer walks that index rather than
    -- scanning the table for the first rows that match.
    -- result set
    SELECT
        -- Keyless and keyed apart, each along its own claim index.
        (SELECT CASE WHEN SUM(n) > @limit THEN @limit ELSE SUM(n) END FROM (
            SELECT COUNT_BIG(*) AS n FROM (
                SELECT TOP (@limit) 1 AS one FROM dbo.workqueue_delivery AS d
                 WHERE d.subscription_id = s.id AND d.status = N'Pending'
                   AND d.partition_key IS NULL
                 ORDER BY d.priority, d.visible_at) AS x
            UNION ALL
            SELECT COUNT_BIG(*) FROM (
                SELECT TOP (@limit) 1 AS one FROM dbo.workqueue_delivery AS d
                 WHERE d.subscription_id = s.id AND d.status = N'Pending'
                   AND d.partition_key IS NOT NULL
                 ORDER BY d.priority, d.visible_at) AS y
        ) AS counts) AS pending,
        -- With the handlers that completed in their own transaction and still run, holding
        -- their keys (wq_complete_holding_key), as wq_backlog counts them.
        (SELECT CASE WHEN SUM(n) > @limit THEN @limit ELSE SUM(n) END FROM (
            SELECT COUNT_BIG(*) AS n FROM (
                SELECT TOP (@limit) 1 AS one FROM dbo.workqueue_delivery AS d
                 WHERE d.subscription_id = s.id AND d.status = N'InFlight'
                 ORDER BY d.status) AS x
            UNION ALL
            SELECT COUNT_BIG(*) FROM (
                SELECT TOP (@limit) 1 AS one FROM dbo.workqueue_delivery AS d
                 WHERE d.subscription_id = s.id AND d.status = N'Completed'
                   AND d.lease_expires_at > @now) AS y
        ) AS counts) AS in_flight,
        (SELECT COUNT_BIG(*) FROM (
            SELECT TOP (@limit) 1 AS one FROM dbo.workqueue_delivery AS d
             WHERE d.subscription_id = s.id AND d.status = N'DeadLettered'
             ORDER BY d.id) AS x) AS dead_lettered,
        CASE WHEN s.partition_mode = N'Ordered' THEN (
            SELECT COUNT_BIG(DISTINCT x.partition_key) FROM (
                SELECT TOP (@limit) d.partition_key FROM dbo.workqueue_delivery AS d
                 WHERE d.subscription_id = s.id AND d.status = N'DeadLettered'
                   AND d.partition_key IS NOT NULL
                   AND NOT EXISTS (
                       SELECT 1 FROM dbo.workqueue_delivery AS h
                        WHERE h.subscription_id = d.subscription_id
                          AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                          AND h.status IN (N'Pending', N'InFlight', N'DeadLettered'))) AS x)
        END AS blocked_keys,
        CASE WHEN @oldest IS NULL THEN NULL
             WHEN @oldest >= @now THEN 0
             ELSE DATEDIFF_BIG(millisecond, @oldest, @now) / 1000 END
            AS oldest_pending_age_seconds
      FROM dbo.workqueue_subscription AS s
     WHERE s.id = @subscription_key;
END;
GO

-- wq_subscription_stats --
-- What wq_queue_gauges reads for one subscription (Pending, InFlight and DeadLettered deliveries,
-- Ordered keys blocked by a dead-lettered head, the age of the oldest Pending delivery), with
-- its completions in the last hour and the database clock, each count made up to @cap
-- (clamped to 1..1000000; NULL: 1000000), along the subscription's own index entries, so that
-- a caller allowed to read one small subscription cannot have the whole table read (the
-- completions among the hour's settled rows, Completed or Discarded, up to the cap). capped is
-- 1 when a count stopped there. No row when the subscription does not exist.
-- Until 0045 the counts were exact, each a scan of what they counted, and there was no @cap;
-- until 0048 the completions were counted among the newest @cap of every subscription's.
-- returns: pending, in_flight, dead_lettered, blocked_keys, oldest_pending_age_seconds, completed_last_hour, as_of, capped
CREATE OR ALTER PROCEDURE dbo.wq_subscription_stats
    @subscription_id uniqueidentifier,
    @cap int = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @limit int = CASE WHEN @cap IS NULL OR @cap > 1000000 THEN 1000000
                              WHEN @cap < 1 THEN 1 ELSE @cap END;
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @gauges TABLE (
        pending bigint,
        in_flight bigint,
        dead_lettered bigint,
        blocked_keys bigint,
        oldest_pending_age_seconds bigint
    );
    INSERT INTO @gauges EXEC dbo.wq_queue_gauges @subscription_id, @limit;
    -- The hour's settled rows, Completed or Discarded as the index holds them, up to the cap:
    -- a bulk discard's million Discarded rows must not be read past it either.
    DECLARE @examined bigint;
    DECLARE @completed bigint;
    SELECT @examined = COUNT_BIG(*),
           @completed = COUNT_BIG(CASE WHEN r.status = N'Completed' THEN 1 END)
      FROM (SELECT TOP (@limit) d.status FROM dbo.workqueue_delivery AS d
             WHERE d.subscription_id = @subscription_key
               AND d.status IN (N'Completed', N'Discarded')
               AND d.completed_at > DATEADD(hour, -1, @now)) AS r;

    -- result set
    SELECT g.pending, g.in_flight, g.dead_lettered, g.blocked_keys,
           g.oldest_pending_age_seconds, @completed AS completed_last_hour, @now AS as_of,
           CAST(CASE WHEN g.pending >= @limit OR g.in_flight >= @limit
                       OR g.dead_lettered >= @limit OR ISNULL(g.blocked_keys, 0) >= @limit
                       OR @examined >= @limit THEN 1 ELSE 0 END AS bit) AS capped
      FROM @gauges AS g;
END;
GO

-- wq_list_dead_letters --
-- One keyset page (by delivery id ascending, after @after_delivery_id; NULL starts at the
-- beginning) of a subscription's dead letters with their messages. blocks_key is 1 for an
-- Ordered key's head, which holds back every later delivery of its key. @with_payload 0 leaves
-- payload and payload_ref NULL, for a caller who may not see them (added in 0040, with a
-- default, so a caller of the three-parameter form reads on).
-- returns: delivery_id, attempt_count, dead_letter_reason, last_error, dead_lettered_at, partition_key, blocks_key, message_id, topic_name, message_partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE dbo.wq_list_dead_letters
    @subscription_id uniqueidentifier,
    @after_delivery_id uniqueidentifier,
    @page_size int,
    @with_payload bit = 1
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @after_key char(32) = dbo.wq_uuid_text(@after_delivery_id);
    -- Clamped to 0..1000 rows (NULL: 1000): the roles that may call this cannot ask for them all.
    DECLARE @limit int = CASE WHEN @page_size IS NULL OR @page_size > 1000 THEN 1000
                              WHEN @page_size < 0 THEN 0 ELSE @page_size END;

    -- result set
    SELECT TOP (@limit)
           dbo.wq_text_uuid(d.id) AS delivery_id,
           d.attempt_count,
           d.dead_letter_reason,
           d.last_error,
           d.dead_lettered_at,
           d.partition_key,
           CAST(CASE WHEN s.partition_mode = N'Ordered' AND d.partition_key IS NOT NULL
                      AND NOT EXISTS (
                          SELECT 1 FROM dbo.workqueue_delivery AS h
                           WHERE h.subscription_id = d.subscription_id
                             AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                             AND h.status IN (N'Pending', N'InFlight', N'DeadLettered'))
                     THEN 1 ELSE 0 END AS bit) AS blocks_key,
           dbo.wq_text_uuid(m.id) AS message_id,
           t.name AS topic_name,
           m.partition_key AS message_partition_key,
           m.attributes,
           CASE WHEN @with_payload = 0 THEN NULL ELSE m.payload END AS payload,
           CASE WHEN @with_payload = 0 THEN NULL ELSE m.payload_ref END AS payload_ref,
           m.correlation_id,
           m.published_at
      FROM dbo.workqueue_delivery AS d
      JOIN dbo.workqueue_subscription AS s ON s.id = d.subscription_id
      JOIN dbo.workqueue_message AS m ON m.id = d.message_id
      JOIN dbo.workqueue_topic AS t ON t.id = m.topic_id
     WHERE d.subscription_id = @subscription_key AND d.status = N'DeadLettered'
       AND (@after_key IS NULL OR d.id > @after_key)
     ORDER BY d.id;
END;
GO

-- wq_list_partitions --
-- One keyset page (by partition key in binary order, after @after_partition_key) of a
-- subscription's keys that have open (Pending, InFlight or DeadLettered) deliveries, as rows of
-- kind 'Partition'. condition: InFlight when any delivery of the key is in flight, else Blocked
-- when an Ordered key's head is dead-lettered, else Idle; @condition NULL lists only the keys
-- that are not Idle. head_delivery_id is the key's earliest open delivery; waiting_items counts
-- the Pending ones among its 1000 oldest open deliveries.
-- The keys are walked one probe of wq_dlv_partition_head_ix at a time (wq_next_open_key), for
-- a page clamped to 0..1000 (NULL: 1000) and at most 4 x page + 64 keys: when that budget runs
-- out before the page is full, a last row of kind 'KeyCursor' carries the last key looked at,
-- where the next page goes on. A call therefore costs what its page allows, however many keys
-- (idle ones included) the subscription has.
-- returns: kind, partition_key, condition, head_delivery_id, waiting_items
CREATE OR ALTER PROCEDURE dbo.wq_list_partitions
    @subscription_id uniqueidentifier,
    @condition nvarchar(4000),
    @after_partition_key nvarchar(4000),
    @page_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @page int = CASE WHEN @page_size IS NULL OR @page_size > 1000 THEN 1000
                             WHEN @page_size < 0 THEN 0 ELSE @page_size END;
    DECLARE @steps int = @page * 4 + 64;
    DECLARE @partition_mode nvarchar(20);
    DECLARE @key nvarchar(200) = @after_partition_key;
    DECLARE @head_id char(32);
    DECLARE @head_status nvarchar(20);
    DECLARE @key_condition nvarchar(20);
    DECLARE @listed int = 0;
    DECLARE @rows TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        kind nvarchar(20),
        partition_key nvarchar(200),
        condition nvarchar(20),
        head_id char(32),
        waiting int
    );

    SELECT @partition_mode = s.partition_mode
      FROM dbo.workqueue_subscription AS s
     WHERE s.id = @subscription_key;

    WHILE @partition_mode IS NOT NULL AND @listed < @page
    BEGIN
        IF @steps = 0
        BEGIN
            INSERT INTO @rows (kind, partition_key) VALUES (N'KeyCursor', @key);
            BREAK;
        END;
        SET @steps -= 1;
        SET @key = dbo.wq_next_open_key(@subscription_key, @key);
        IF @key IS NULL
            BREAK;

        SET @head_id = NULL;
        SET @head_status = NULL;
        SELECT TOP (1) @head_id = h.id, @head_status = h.status
          FROM dbo.workqueue_delivery AS h
         WHERE h.subscription_id = @subscription_key AND h.partition_key = @key
           AND h.status IN (N'Pending', N'InFlight', N'DeadLettered')
         ORDER BY h.order_key;
        SET @key_condition = CASE
            WHEN EXISTS (SELECT 1 FROM dbo.workqueue_delivery AS f
                          WHERE f.subscription_id = @subscription_key
                            AND f.partition_key = @key AND f.status = N'InFlight')
                THEN N'InFlight'
            -- Completed in its handler's transaction, whose handler still runs and holds the
            -- key (wq_complete_holding_key).
            WHEN EXISTS (SELECT 1 FROM dbo.workqueue_delivery AS k
                          WHERE k.subscription_id = @subscription_key
                            AND k.partition_key = @key AND k.status = N'Completed'
                            AND k.lease_expires_at > SYSDATETIMEOFFSET())
                THEN N'InFlight'
            WHEN @partition_mode = N'Ordered' AND @head_status = N'DeadLettered' THEN N'Blocked'
            ELSE N'Idle' END;
        IF (@condition IS NULL AND @key_condition = N'Idle')
           OR (@condition IS NOT NULL AND @key_condition <> @condition)
            CONTINUE;

        SET @listed += 1;
        INSERT INTO @rows (kind, partition_key, condition, head_id, waiting)
        SELECT N'Partition', @key, @key_condition, @head_id,
               COUNT(CASE WHEN o.status = N'Pending' THEN 1 END)
          FROM (SELECT TOP (1000) w.status
                  FROM dbo.workqueue_delivery AS w
                 WHERE w.subscription_id = @subscription_key AND w.partition_key = @key
                   AND w.status IN (N'Pending', N'InFlight', N'DeadLettered')
                 ORDER BY w.order_key) AS o;
    END;

    -- result set
    SELECT r.kind,
           r.partition_key,
           r.condition,
           dbo.wq_text_uuid(r.head_id) AS head_delivery_id,
           r.waiting AS waiting_items
      FROM @rows AS r
     ORDER BY r.ord;
END;
GO

-- wq_replay --
-- DeadLettered -> Pending, visible now, with attempts reset to 0 and is_replay set; the reason
-- and time of the dead letter are cleared and the actor and note (cut to 1000 characters)
-- recorded. The order key is kept, so a replayed Ordered head keeps its place in its key.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_replay
    @subscription_id uniqueidentifier,
    @delivery_id uniqueidentifier,
    @actor nvarchar(4000),
    @note nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Pending', attempt_count = 0, is_replay = 1, visible_at = @now,
           dead_letter_reason = NULL, dead_lettered_at = NULL,
           resolved_by = @actor, resolution_note = LEFT(@note, 1000)
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.subscription_id = @subscription_key
       AND d.status = N'DeadLettered';

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_discard --
-- DeadLettered (or Pending, when @allow_pending = 1) -> Discarded, completed now, with the actor
-- and reason recorded and any lease columns cleared. Never touches an InFlight delivery; that
-- needs wq_cancel. Waits at most 2 s for a row another transaction holds, then fails with error
-- 1222 (an operator's request must not hang for as long as a handler keeps open the transaction
-- it completes its delivery in); the setting ends with the procedure.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_discard
    @subscription_id uniqueidentifier,
    @delivery_id uniqueidentifier,
    @allow_pending bit,
    @actor nvarchar(4000),
    @reason nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    SET LOCK_TIMEOUT 2000;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Discarded', completed_at = @now,
           resolved_by = @actor, resolution_note = LEFT(@reason, 1000),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.subscription_id = @subscription_key
       AND (d.status = N'DeadLettered' OR (@allow_pending = 1 AND d.status = N'Pending'));

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_resolve_dead_letters --
-- One bounded batch of a bulk replay or discard: examines the subscription's next dead letters
-- by delivery id after @after_delivery_id (at most @batch_size, clamped to 1..5000; NULL: 1000)
-- and replays (@action 'Replay', as wq_replay does) or discards ('Discard', as wq_discard does)
-- those matching every filter given (NULL matches all): the dead-letter reason (ignoring case),
-- the message's partition key (exactly, whatever the partition mode), the time of the dead
-- letter in [from, before), and the last error containing the text (ignoring case). With
-- @dry_run = 1 nothing changes: changed reports how many would. last_delivery_id is where the
-- next batch starts; a batch that examined fewer rows than its size was the last. Each batch is
-- its own transaction. The batch is read without update locks, and a row is changed only while
-- it is still the dead letter the batch examined (its status and its dead_lettered_at): until
-- 0060 a dry run locked its batch too (review helper-183).
-- returns: examined, changed, last_delivery_id
CREATE OR ALTER PROCEDURE dbo.wq_resolve_dead_letters
    @subscription_id uniqueidentifier,
    @action nvarchar(4000),
    @reason nvarchar(4000),
    @partition_key nvarchar(4000),
    @dead_lettered_from datetimeoffset(7),
    @dead_lettered_before datetimeoffset(7),
    @error_contains nvarchar(4000),
    @after_delivery_id uniqueidentifier,
    @batch_size int,
    @dry_run bit,
    @actor nvarchar(4000),
    @note nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    IF @action IS NULL OR @action NOT IN (N'Replay', N'Discard')
        THROW 51010, N'wq_resolve_dead_letters: @action must be Replay or Discard (error 51010).', 1;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @after_key char(32) = dbo.wq_uuid_text(@after_delivery_id);
    DECLARE @limit int = CASE WHEN @batch_size IS NULL THEN 1000
                              WHEN @batch_size > 5000 THEN 5000
                              WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    DECLARE @batch TABLE (
        id char(32) PRIMARY KEY, dead_lettered_at datetimeoffset(7) NULL, matches bit NOT NULL
    );
    DECLARE @changed int = 0;

    BEGIN TRANSACTION;
    -- The batch in id order.
    INSERT INTO @batch (id, dead_lettered_at, matches)
    SELECT TOP (@limit) d.id, d.dead_lettered_at,
           CASE WHEN (@reason IS NULL OR LOWER(d.dead_letter_reason) = LOWER(@reason))
                 AND (@partition_key IS NULL OR EXISTS (
                      SELECT 1 FROM dbo.workqueue_message AS m
                       WHERE m.id = d.message_id AND m.partition_key = @partition_key
                         -- Exactly the key given: = ignores trailing spaces.
                         AND DATALENGTH(m.partition_key) = DATALENGTH(@partition_key)))
                 AND (@dead_lettered_from IS NULL OR d.dead_lettered_at >= @dead_lettered_from)
                 AND (@dead_lettered_before IS NULL OR d.dead_lettered_at < @dead_lettered_before)
                 AND (@error_contains IS NULL
                      OR CHARINDEX(LOWER(@error_contains), LOWER(COALESCE(d.last_error, N''))) > 0)
                THEN 1 ELSE 0 END
      FROM dbo.workqueue_delivery AS d
     WHERE d.subscription_id = @subscription_key AND d.status = N'DeadLettered'
       AND (@after_key IS NULL OR d.id > @after_key)
     ORDER BY d.id;

    IF @dry_run = 1
        SELECT @changed = COUNT(*) FROM @batch WHERE matches = 1;
    ELSE IF @action = N'Replay'
    BEGIN
        UPDATE d
           SET status = N'Pending', attempt_count = 0, is_replay = 1, visible_at = @now,
               dead_letter_reason = NULL, dead_lettered_at = NULL,
               resolved_by = @actor, resolution_note = LEFT(@note, 1000)
          FROM dbo.workqueue_delivery AS d
          JOIN @batch AS b ON b.id = d.id AND b.matches = 1
         WHERE d.status = N'DeadLettered'
           AND (d.dead_lettered_at = b.dead_lettered_at
                OR d.dead_lettered_at IS NULL AND b.dead_lettered_at IS NULL);
        SET @changed = @@ROWCOUNT;
    END
    ELSE
    BEGIN
        UPDATE d
           SET status = N'Discarded', completed_at = @now,
               resolved_by = @actor, resolution_note = LEFT(@note, 1000),
               lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
          FROM dbo.workqueue_delivery AS d
          JOIN @batch AS b ON b.id = d.id AND b.matches = 1
         WHERE d.status = N'DeadLettered'
           AND (d.dead_lettered_at = b.dead_lettered_at
                OR d.dead_lettered_at IS NULL AND b.dead_lettered_at IS NULL);
        SET @changed = @@ROWCOUNT;
    END
    COMMIT TRANSACTION;

    -- result set
    SELECT (SELECT COUNT(*) FROM @batch) AS examined,
           @changed AS changed,
           dbo.wq_text_uuid((SELECT MAX(id) FROM @batch)) AS last_delivery_id;
END;
GO

-- wq_discard_pending --
-- One bounded batch of a bulk discard of waiting work: walks the subscription's Pending
-- deliveries along one claim index (@keyed = 1: those with a partition key, else those without),
-- in (priority, visible_at, id) order after (@after_priority, @after_visible_at,
-- @after_delivery_id), at most @batch_size
-- of them (clamped to 1..5000; NULL: 1000), and discards those matching every filter given (NULL
-- matches all): the message's partition key (exactly), its publish time in [from, before), and
-- the last error of an earlier attempt containing the text (ignoring case). Rows another
-- session holds locked at that moment (a claim taking them) are examined and skipped, never
-- changed (they are being claimed: cancel them one by one). With @dry_run = 1 nothing changes
-- and nothing is locked: changed reports how many would (until 0058 a dry run locked what it
-- walked too, and a real run beside it skipped those rows: review helper-183). The last row
-- examined is where the next batch starts; a batch that examined fewer rows than its size was
-- the last.
-- Until 0056 the walk itself read past locked rows (READPAST) uncounted, and went on until it
-- had examined its size in rows no one held: behind rows held by open transactions, as many as
-- there were, in one call (review helper-176). Now it reads its rows without locks (the
-- committed versions: READ_COMMITTED_SNAPSHOT is on, as validate-bindings requires), so a
-- held one still counts, then changes those that match and no other session holds.
-- returns: examined, changed, last_priority, last_visible_at, last_delivery_id
CREATE OR ALTER PROCEDURE dbo.wq_discard_pending
    @subscription_id uniqueidentifier,
    @keyed bit,
    @partition_key nvarchar(4000),
    @published_from datetimeoffset(7),
    @published_before datetimeoffset(7),
    @error_contains nvarchar(4000),
    @after_priority int,
    @after_visible_at datetimeoffset(7),
    @after_delivery_id uniqueidentifier,
    @batch_size int,
    @dry_run bit,
    @actor nvarchar(4000),
    @reason nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @after_key char(32) = dbo.wq_uuid_text(@after_delivery_id);
    DECLARE @limit int = CASE WHEN @batch_size IS NULL THEN 1000
                              WHEN @batch_size > 5000 THEN 5000
                              WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    DECLARE @walked TABLE (
        id char(32) PRIMARY KEY,
        priority int NOT NULL,
        visible_at datetimeoffset(7) NOT NULL,
        matches bit NOT NULL
    );
    DECLARE @changed int = 0;

    BEGIN TRANSACTION;
    INSERT INTO @walked (id, priority, visible_at, matches)
    SELECT TOP (@limit) d.id, d.priority, d.visible_at,
           CASE WHEN (@error_contains IS NULL
                      OR CHARINDEX(LOWER(@error_contains), LOWER(COALESCE(d.last_error, N''))) > 0)
                 AND (@partition_key IS NULL AND @published_from IS NULL
                      AND @published_before IS NULL
                      OR EXISTS (
                          SELECT 1 FROM dbo.workqueue_message AS m
                           WHERE m.id = d.message_id
                             AND (@partition_key IS NULL
                                  OR (m.partition_key = @partition_key
                                      -- Exactly the key given: = ignores trailing spaces.
                                      AND DATALENGTH(m.partition_key)
                                          = DATALENGTH(@partition_key)))
                             AND (@published_from IS NULL OR m.published_at >= @published_from)
                             AND (@published_before IS NULL
                                  OR m.published_at < @published_before)))
                THEN 1 ELSE 0 END
      FROM dbo.workqueue_delivery AS d
     WHERE d.subscription_id = @subscription_key AND d.status = N'Pending'
       AND ((@keyed = 1 AND d.partition_key IS NOT NULL)
            OR (@keyed = 0 AND d.partition_key IS NULL))
       -- The resume point comes back from Python in whole microseconds while visible_at holds
       -- 100 ns ticks: rows within the microsecond of the last one examined resume by id.
       AND (@after_visible_at IS NULL
            OR d.priority > @after_priority
            OR (d.priority = @after_priority
                AND (d.visible_at >= DATEADD(microsecond, 1, @after_visible_at)
                     OR (d.visible_at >= @after_visible_at AND d.id > @after_key))))
     ORDER BY d.priority, d.visible_at, d.id
    -- Compiled with the values in place, so the key predicate matches a filtered claim index.
    OPTION (RECOMPILE);

    IF @dry_run = 1
        SELECT @changed = COUNT(*) FROM @walked WHERE matches = 1;
    ELSE
    BEGIN
        -- The matching rows no other session holds (READPAST), locked and changed in one
        -- statement; what a dry run walked, it never locked.
        UPDATE d
           SET status = N'Discarded', completed_at = @now,
               resolved_by = @actor, resolution_note = LEFT(@reason, 1000)
          FROM @walked AS w
          JOIN dbo.workqueue_delivery AS d WITH (UPDLOCK, ROWLOCK, READPAST)
            ON d.id = w.id AND w.matches = 1
         WHERE d.status = N'Pending'
           -- Read again on the locked row: a retry since the walk may have changed it.
           AND (@error_contains IS NULL
                OR CHARINDEX(LOWER(@error_contains), LOWER(COALESCE(d.last_error, N''))) > 0);
        SET @changed = @@ROWCOUNT;
    END
    COMMIT TRANSACTION;

    -- result set
    SELECT (SELECT COUNT(*) FROM @walked) AS examined,
           @changed AS changed,
           (SELECT TOP (1) priority FROM @walked
             ORDER BY priority DESC, visible_at DESC, id DESC) AS last_priority,
           (SELECT TOP (1) visible_at FROM @walked
             ORDER BY priority DESC, visible_at DESC, id DESC) AS last_visible_at,
           dbo.wq_text_uuid((SELECT TOP (1) id FROM @walked
                              ORDER BY priority DESC, visible_at DESC, id DESC))
               AS last_delivery_id;
END;
GO

-- wq_cancel --
-- Ask the holder of an InFlight delivery to stop: set the cancel flag (once) and record the
-- actor and reason. The lease token is left alone so the holder can acknowledge and free its key
-- at once; if it never does, lease expiry discards the delivery. A cancelled delivery never runs
-- again. Also a Completed delivery whose handler completed it in its own transaction and runs
-- on, holding its partition key (wq_complete_holding_key): it stays Completed, its handler is
-- told at its next renewal, and the key is free when the handler returns or the hold's lease
-- ends (until 0065 nothing reached such a handler: review helper-199). Waits at most 2 s for
-- the row, then fails with error 1222, as wq_discard does.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_cancel
    @subscription_id uniqueidentifier,
    @delivery_id uniqueidentifier,
    @actor nvarchar(4000),
    @reason nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    SET LOCK_TIMEOUT 2000;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET cancel_requested_at = @now,
           resolved_by = @actor, resolution_note = LEFT(@reason, 1000)
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.subscription_id = @subscription_key
       AND (d.status = N'InFlight'
            OR (d.status = N'Completed' AND d.lease_expires_at > @now))
       AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_backlog --
-- What an autoscaler needs: claimable deliveries (visible keyless Pending rows, plus one per key
-- that could be claimed now under the subscription's partition mode; 0 unless the subscription
-- is Active and its topic and transport are too, as wq_claim decides) and InFlight rows (which
-- run to their end whatever those statuses), each counted up to @cap, clamped to 0..1000 (NULL: 1000) since
-- the scaler role may call this directly. No row when the subscription does not exist. Keys
-- are counted by walking wq_dlv_partition_head_ix one key at a time (as wq_claim walks them),
-- so a hot key's blocked backlog costs one step, not its rows; the walk takes at most
-- 4 x cap + 64 steps, so keys behind that many keys that cannot run now are left out.
-- returns: claimable, in_flight
CREATE OR ALTER PROCEDURE dbo.wq_backlog
    @subscription_id uniqueidentifier,
    @cap int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    SET LOCK_TIMEOUT 2000;  -- as wq_queue_gauges
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @limit int = CASE WHEN @cap IS NULL OR @cap > 1000 THEN 1000
                              WHEN @cap < 0 THEN 0 ELSE @cap END;
    DECLARE @steps int = @limit * 4 + 64;
    DECLARE @partition_mode nvarchar(20);
    DECLARE @subscription_status nvarchar(20);
    DECLARE @claimable int = 0;
    DECLARE @in_flight int = 0;
    DECLARE @level int;
    DECLARE @key nvarchar(200);
    DECLARE @head_status nvarchar(20);
    DECLARE @head_visible_at datetimeoffset(7);

    -- A Disabled topic or transport stops claims as a Paused subscription does: an autoscaler
    -- must not start hosts for work none of them may claim.
    SELECT @partition_mode = s.partition_mode,
           @subscription_status = CASE WHEN t.status = N'Active' AND tr.status = N'Active'
                                       THEN s.status ELSE N'Paused' END
      FROM dbo.workqueue_subscription AS s
      JOIN dbo.workqueue_topic AS t ON t.id = s.topic_id
      JOIN dbo.workqueue_transport AS tr ON tr.id = t.transport_id
     WHERE s.id = @subscription_key;

    IF @subscription_status IS NOT NULL
    BEGIN
        SELECT @in_flight = COUNT(*) FROM (
            SELECT TOP (@limit) d.id FROM dbo.workqueue_delivery AS d
             WHERE d.subscription_id = @subscription_key AND d.status = N'InFlight') AS held;
        -- With the handlers that completed in their own transaction and still run, holding
        -- their keys (wq_complete_holding_key).
        SELECT @in_flight += COUNT(*) FROM (
            SELECT TOP (@limit) d.id FROM dbo.workqueue_delivery AS d
             WHERE d.subscription_id = @subscription_key AND d.status = N'Completed'
               AND d.lease_expires_at > @now) AS holding;
        IF @in_flight > @limit
            SET @in_flight = @limit;
    END;

    IF @subscription_status = N'Active'
    BEGIN
        -- Keyless rows already due, a priority at a time as wq_claim reads them, so rows
        -- scheduled for later are neither counted nor read.
        SET @level = 101;
        WHILE @claimable < @limit
        BEGIN
            SET @level = dbo.wq_next_priority(@subscription_key, 0, @level);
            IF @level IS NULL
                BREAK;
            SELECT @claimable += COUNT(*) FROM (
                SELECT TOP (@limit - @claimable) d.id FROM dbo.workqueue_delivery AS d
                 WHERE d.subscription_id = @subscription_key AND d.status = N'Pending'
                   AND d.partition_key IS NULL AND d.priority = @level
                   AND d.visible_at <= @now) AS keyless;
        END;

        WHILE @partition_mode <> N'None' AND @claimable < @limit AND @steps > 0
        BEGIN
            SET @steps -= 1;
            SET @key = dbo.wq_next_open_key(@subscription_key, @key);
            IF @key IS NULL
                BREAK;

            IF @partition_mode = N'Ordered'
            BEGIN
                -- Claimable when the key's head is a visible Pending delivery.
                SET @head_status = NULL;
                SELECT TOP (1) @head_status = h.status, @head_visible_at = h.visible_at
                  FROM dbo.workqueue_delivery AS h
                 WHERE h.subscription_id = @subscription_key AND h.partition_key = @key
                   AND h.status IN (N'Pending', N'InFlight', N'DeadLettered')
                 ORDER BY h.order_key;
                IF @head_status = N'Pending' AND @head_visible_at <= @now
                   AND NOT EXISTS (
                       SELECT 1 FROM dbo.workqueue_delivery AS k
                        WHERE k.subscription_id = @subscription_key AND k.partition_key = @key
                          AND k.status = N'Completed' AND k.lease_expires_at > @now)
                    SET @claimable += 1;
            END
            ELSE IF NOT EXISTS (
                    SELECT 1 FROM dbo.workqueue_delivery AS f
                     WHERE f.subscription_id = @subscription_key AND f.partition_key = @key
                       AND f.status = N'InFlight')
                AND NOT EXISTS (
                    -- Nor a key held by a handler that completed in its own transaction.
                    SELECT 1 FROM dbo.workqueue_delivery AS k
                     WHERE k.subscription_id = @subscription_key AND k.partition_key = @key
                       AND k.status = N'Completed' AND k.lease_expires_at > @now)
                AND EXISTS (
                    SELECT 1 FROM dbo.workqueue_delivery AS c
                     WHERE c.subscription_id = @subscription_key AND c.partition_key = @key
                       AND c.status = N'Pending' AND c.visible_at <= @now)
                SET @claimable += 1;
        END;
    END;

    -- result set
    SELECT CASE WHEN @claimable > @limit THEN @limit ELSE @claimable END AS claimable,
           @in_flight AS in_flight
      FROM dbo.workqueue_subscription AS s
     WHERE s.id = @subscription_key;
END;
GO

-- wq_read_committed_snapshot_state --
-- Whether this database runs READ COMMITTED with row versioning (READ_COMMITTED_SNAPSHOT ON),
-- which the work queue requires on SQL Server so that readers never block claims. Exactly one
-- row: the current database is always visible in sys.databases to its own users.
-- returns: snapshot_on
CREATE OR ALTER PROCEDURE dbo.wq_read_committed_snapshot_state
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;

    -- result set
    SELECT CAST(db.is_read_committed_snapshot_on AS bit) AS snapshot_on
      FROM sys.databases AS db
     WHERE db.database_id = DB_ID();
END;
GO

-- wq_retire_discard --
-- Retiring a subscription: up to @batch_size (clamped to 1..5000; NULL: 1000, as the other operator
-- batches: until 0056 from below only, review helper-176) of its Pending and DeadLettered
-- deliveries -> Discarded, with the actor and reason recorded. Only for a Disabled subscription (no
-- new deliveries are fanned out to it, no host claims it); for any other it changes nothing.
-- InFlight rows are left to their holders.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_retire_discard
    @subscription_id uniqueidentifier,
    @actor nvarchar(4000),
    @reason nvarchar(max),
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @limit int = CASE WHEN @batch_size IS NULL THEN 1000
                              WHEN @batch_size > 5000 THEN 5000
                              WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Discarded', completed_at = @now,
           resolved_by = @actor, resolution_note = LEFT(@reason, 1000),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id IN (
               SELECT TOP (@limit) x.id
                 FROM dbo.workqueue_delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
                 JOIN dbo.workqueue_subscription AS s ON s.id = x.subscription_id
                WHERE x.subscription_id = @subscription_key AND s.status = N'Disabled'
                  AND x.status IN (N'Pending', N'DeadLettered'))
       AND d.status IN (N'Pending', N'DeadLettered');

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_retire_purge --
-- Retiring a subscription: delete up to @batch_size (clamped as wq_retire_discard's) of its
-- Completed and Discarded deliveries whatever their age, so its row can be deleted. Only for a
-- Disabled subscription; for any other it deletes nothing. Never a Pending, InFlight or
-- DeadLettered row, nor a Completed one whose handler runs on holding its key (its hold's
-- lease unexpired: review helper-199).
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_retire_purge
    @subscription_id uniqueidentifier,
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @limit int = CASE WHEN @batch_size IS NULL THEN 1000
                              WHEN @batch_size > 5000 THEN 5000
                              WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @deleted TABLE (id char(32));

    DELETE d
    OUTPUT deleted.id INTO @deleted
      FROM dbo.workqueue_delivery AS d
     WHERE d.id IN (
               SELECT TOP (@limit) x.id
                 FROM dbo.workqueue_delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
                 JOIN dbo.workqueue_subscription AS s ON s.id = x.subscription_id
                WHERE x.subscription_id = @subscription_key AND s.status = N'Disabled'
                  AND x.status IN (N'Completed', N'Discarded')
                  AND NOT (x.status = N'Completed' AND x.lease_expires_at IS NOT NULL
                           AND x.lease_expires_at > @now))
       AND d.status IN (N'Completed', N'Discarded');

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @deleted;
END;
GO
