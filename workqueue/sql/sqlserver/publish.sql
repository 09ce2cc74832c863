-- Publishing: one transaction per call that checks the topic, takes the ordered-publish lock,
-- reserves the deduplication key, inserts the message, fans it out to every matching
-- subscription in one set-based INSERT and confirms the key. SQL Server has no NOTIFY, so
-- consumers find new deliveries by polling and nothing replaces PostgreSQL's wq_topic_channel.

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_uuid_text --
-- The stored form of a UUID: Django's UUIDField is char(32) on SQL Server, lower-case hex
-- without dashes. Deterministic; NULL in, NULL out.
CREATE OR ALTER FUNCTION dbo.wq_uuid_text(@value uniqueidentifier)
RETURNS char(32)
WITH SCHEMABINDING
AS
BEGIN
    RETURN LOWER(REPLACE(CONVERT(char(36), @value), '-', ''));
END;
GO

-- wq_text_uuid --
-- The inverse of wq_uuid_text: a stored char(32) id back as a uniqueidentifier, so every
-- procedure returns real UUIDs (the driver lower-cases them). Deterministic; NULL in, NULL out.
CREATE OR ALTER FUNCTION dbo.wq_text_uuid(@value char(32))
RETURNS uniqueidentifier
WITH SCHEMABINDING
AS
BEGIN
    RETURN CONVERT(
        uniqueidentifier,
        STUFF(STUFF(STUFF(STUFF(@value, 21, 0, '-'), 17, 0, '-'), 13, 0, '-'), 9, 0, '-')
    );
END;
GO

-- wq_publish_ordinal_seq --
-- The global publish order. Each accepted message takes the next value, after its ordered-publish
-- lock is held, and its deliveries copy it into order_key. Created once; re-running is harmless.
IF OBJECT_ID(N'dbo.wq_publish_ordinal_seq', N'SO') IS NULL
    CREATE SEQUENCE dbo.wq_publish_ordinal_seq AS bigint START WITH 1 INCREMENT BY 1 CACHE 50;
GO

-- wq_lock_publish_order --
-- Serialise publishes of one (topic, partition key) so that their publish ordinals commit in key
-- order. Takes an exclusive application lock owned by the caller's transaction (released at
-- commit or rollback), on the resource 'wq:<topic id, lower case>:<key exactly>' (application
-- lock names compare byte for byte). Waits at most 5000 ms; a timeout or a deadlock raises error
-- 51001, which the driver treats as retryable; any other failure raises 51000. Must be called
-- inside a transaction.
CREATE OR ALTER PROCEDURE dbo.wq_lock_publish_order
    @topic_id uniqueidentifier,
    @partition_key nvarchar(4000)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @resource nvarchar(255) =
        LEFT(N'wq:' + LOWER(CONVERT(nchar(36), @topic_id)) + N':' + @partition_key, 255);
    DECLARE @granted int;

    IF @@TRANCOUNT = 0
        THROW 51000, N'wq_lock_publish_order must run inside a transaction (error 51000).', 1;

    EXEC @granted = sys.sp_getapplock
        @Resource = @resource,
        @LockMode = N'Exclusive',
        @LockOwner = N'Transaction',
        @LockTimeout = 5000;

    IF @granted IN (-1, -3)
        THROW 51001, N'wq_lock_publish_order: the ordered-publish lock was not granted within 5000 ms (error 51001); publish again.', 1;
    IF @granted < 0
        THROW 51000, N'wq_lock_publish_order: sp_getapplock failed (error 51000).', 1;
END;
GO

-- wq_lock_deduplication_key --
-- Serialise the publishes that reserve one (topic, deduplication key), taken before the
-- reservation: a batch (wq_publish_many) takes its keys' locks in sorted order before it
-- reserves any, so two batches listing shared keys in different orders, or a batch and an
-- enlisted transaction's single publishes, wait for one another instead of deadlocking on
-- the reservations.
-- An exclusive application lock owned by the caller's transaction, on the resource
-- 'wq-dedup:<topic id, lower case>:<key exactly>'. Waits at most 5000 ms; a timeout or a
-- deadlock raises error 51001 (retryable); any other failure raises 51000. Must be called inside
-- a transaction.
CREATE OR ALTER PROCEDURE dbo.wq_lock_deduplication_key
    @topic_id uniqueidentifier,
    @deduplication_key nvarchar(4000)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @resource nvarchar(255) =
        LEFT(N'wq-dedup:' + LOWER(CONVERT(nchar(36), @topic_id)) + N':' + @deduplication_key, 255);
    DECLARE @granted int;

    IF @@TRANCOUNT = 0
        THROW 51000, N'wq_lock_deduplication_key must run inside a transaction (error 51000).', 1;

    EXEC @granted = sys.sp_getapplock
        @Resource = @resource,
        @LockMode = N'Exclusive',
        @LockOwner = N'Transaction',
        @LockTimeout = 5000;

    IF @granted IN (-1, -3)
        THROW 51001, N'wq_lock_deduplication_key: the deduplication lock was not granted within 5000 ms (error 51001); publish again.', 1;
    IF @granted < 0
        THROW 51000, N'wq_lock_deduplication_key: sp_getapplock failed (error 51000).', 1;
END;
GO

-- wq_lock_topology --
-- returns: locked
-- Take the transaction-owned application lock that orders a topic's subscription changes against
-- its publishes: publishes hold it shared while they fan out; a change that depends on the
-- subscription having no deliveries (the partition mode) takes it exclusive. Waits at most
-- 5000 ms; a timeout raises error 51001 (retryable). Must be called inside a transaction.
CREATE OR ALTER PROCEDURE dbo.wq_lock_topology
    @topic_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @granted int;
    DECLARE @resource nvarchar(255) = N'wq-topology:' + LOWER(CONVERT(nchar(36), @topic_id));

    IF @@TRANCOUNT = 0
        THROW 51000, N'wq_lock_topology must run inside a transaction (error 51000).', 1;

    EXEC @granted = sys.sp_getapplock
        @Resource = @resource,
        @LockMode = N'Exclusive',
        @LockOwner = N'Transaction',
        @LockTimeout = 5000;

    IF @granted IN (-1, -3)
        THROW 51001, N'wq_lock_topology: the topology lock was not granted within 5000 ms (error 51001).', 1;
    IF @granted < 0
        THROW 51000, N'wq_lock_topology: sp_getapplock failed (error 51000).', 1;

    -- result set
    SELECT CAST(1 AS bit) AS locked;
END;
GO

-- wq_subscription_delete_guard, wq_topic_delete_guard --
-- Triggers: a subscription that still has deliveries, or a topic that still has messages, cannot
-- be deleted, whatever deletes it (the ORM refuses first, with ProtectedError); error 51011. The
-- queue tables hold no foreign keys to them (a check per inserted row). Each guard takes the
-- topology lock of every topic concerned exclusive before it looks, in topic order, as
-- wq_lock_topology does: a publish fanning out at that moment commits first and is seen, and one
-- that starts later waits for this transaction. Like a foreign key, a guard is off while its
-- table's foreign keys are switched off (NOCHECK): a flush (mssql-django's sql_flush, for
-- TransactionTestCase and manage.py flush) sets every constraint NOCHECK, deletes table by table
-- in no particular order, then checks again.
CREATE OR ALTER TRIGGER dbo.wq_subscription_delete_guard
ON dbo.workqueue_subscription
AFTER DELETE
AS
BEGIN
    SET NOCOUNT ON;
    IF EXISTS (SELECT 1 FROM sys.foreign_keys
                WHERE parent_object_id = OBJECT_ID(N'dbo.workqueue_subscription') AND is_disabled = 1)
        RETURN;
    DECLARE @topic_key char(32);
    DECLARE @resource nvarchar(255);
    DECLARE @granted int;
    DECLARE deleted_topics CURSOR LOCAL FAST_FORWARD FOR
        SELECT DISTINCT topic_id FROM deleted ORDER BY topic_id;
    OPEN deleted_topics;
    FETCH NEXT FROM deleted_topics INTO @topic_key;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        SET @resource = N'wq-topology:' + LOWER(CONVERT(nchar(36), dbo.wq_text_uuid(@topic_key)));
        EXEC @granted = sys.sp_getapplock
            @Resource = @resource,
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 5000;
        IF @granted < 0
            THROW 51001, N'wq_subscription_delete_guard: the topology lock was not granted within 5000 ms (error 51001); delete again.', 1;
        FETCH NEXT FROM deleted_topics INTO @topic_key;
    END;
    CLOSE deleted_topics;
    DEALLOCATE deleted_topics;
    IF EXISTS (SELECT 1 FROM deleted s JOIN dbo.workqueue_delivery d ON d.subscription_id = s.id)
        THROW 51011, N'A subscription that still has deliveries cannot be deleted (error 51011); retire it instead: manage.py workqueue retire-subscription NAME.', 1;
END;
GO

CREATE OR ALTER TRIGGER dbo.wq_topic_delete_guard
ON dbo.workqueue_topic
AFTER DELETE
AS
BEGIN
    SET NOCOUNT ON;
    IF EXISTS (SELECT 1 FROM sys.foreign_keys
                WHERE parent_object_id = OBJECT_ID(N'dbo.workqueue_topic') AND is_disabled = 1)
        RETURN;
    DECLARE @topic_key char(32);
    DECLARE @resource nvarchar(255);
    DECLARE @granted int;
    DECLARE deleted_topics CURSOR LOCAL FAST_FORWARD FOR
        SELECT id FROM deleted ORDER BY id;
    OPEN deleted_topics;
    FETCH NEXT FROM deleted_topics INTO @topic_key;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        SET @resource = N'wq-topology:' + LOWER(CONVERT(nchar(36), dbo.wq_text_uuid(@topic_key)));
        EXEC @granted = sys.sp_getapplock
            @Resource = @resource,
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 5000;
        IF @granted < 0
            THROW 51001, N'wq_topic_delete_guard: the topology lock was not granted within 5000 ms (error 51001); delete again.', 1;
        FETCH NEXT FROM deleted_topics INTO @topic_key;
    END;
    CLOSE deleted_topics;
    DEALLOCATE deleted_topics;
    IF EXISTS (SELECT 1 FROM deleted t JOIN dbo.workqueue_message m ON m.topic_id = t.id)
        THROW 51011, N'A topic that still has messages cannot be deleted (error 51011); retention purges them retention_days after publish once their deliveries settled.', 1;
END;
GO

-- wq_subscription_mode_guard --
-- Trigger: a subscription's partition mode cannot change once it has deliveries, whatever
-- writes the row (the model's validation refuses first; a role with the topology tables' DML
-- turned an Ordered subscription whose key a dead letter blocks into Exclusive with one UPDATE:
-- review helper-173); error 51012. Takes the topology lock of each topic concerned first, in
-- topic order, as the delete guards do. Off while the table's foreign keys are (a flush).
CREATE OR ALTER TRIGGER dbo.wq_subscription_mode_guard
ON dbo.workqueue_subscription
AFTER UPDATE
AS
BEGIN
    SET NOCOUNT ON;
    IF NOT UPDATE(partition_mode)
        RETURN;
    IF EXISTS (SELECT 1 FROM sys.foreign_keys
                WHERE parent_object_id = OBJECT_ID(N'dbo.workqueue_subscription') AND is_disabled = 1)
        RETURN;
    IF NOT EXISTS (SELECT 1 FROM inserted i JOIN deleted o ON o.id = i.id
                    WHERE i.partition_mode <> o.partition_mode)
        RETURN;
    DECLARE @topic_key char(32);
    DECLARE @resource nvarchar(255);
    DECLARE @granted int;
    DECLARE changed_topics CURSOR LOCAL FAST_FORWARD FOR
        SELECT DISTINCT o.topic_id FROM inserted i JOIN deleted o ON o.id = i.id
         WHERE i.partition_mode <> o.partition_mode ORDER BY o.topic_id;
    OPEN changed_topics;
    FETCH NEXT FROM changed_topics INTO @topic_key;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        SET @resource = N'wq-topology:' + LOWER(CONVERT(nchar(36), dbo.wq_text_uuid(@topic_key)));
        EXEC @granted = sys.sp_getapplock
            @Resource = @resource,
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 5000;
        IF @granted < 0
            THROW 51001, N'wq_subscription_mode_guard: the topology lock was not granted within 5000 ms (error 51001); update again.', 1;
        FETCH NEXT FROM changed_topics INTO @topic_key;
    END;
    CLOSE changed_topics;
    DEALLOCATE changed_topics;
    IF EXISTS (SELECT 1 FROM inserted i JOIN deleted o ON o.id = i.id
                JOIN dbo.workqueue_delivery d ON d.subscription_id = i.id
                WHERE i.partition_mode <> o.partition_mode)
        THROW 51012, N'A subscription''s partition mode cannot change once it has deliveries (error 51012); create a new subscription with the mode instead.', 1;
END;
GO

-- wq_subscription_ordered_guard --
-- Trigger: a subscription that becomes one whose keys a publish must lock (Ordered and not
-- Disabled, made so, enabled, refiltered or moved to another topic) takes the topology lock of
-- each topic concerned, in topic order, whatever writes the row: a publish that decided not to
-- lock its key and then fanned out to it wrote a delivery whose key it never locked (review
-- helper-179). A change of mode is wq_subscription_mode_guard's. Off while the table's foreign
-- keys are (a flush).
CREATE OR ALTER TRIGGER dbo.wq_subscription_ordered_guard
ON dbo.workqueue_subscription
AFTER INSERT, UPDATE
AS
BEGIN
    SET NOCOUNT ON;
    IF EXISTS (SELECT 1 FROM sys.foreign_keys
                WHERE parent_object_id = OBJECT_ID(N'dbo.workqueue_subscription') AND is_disabled = 1)
        RETURN;
    DECLARE @topic_key char(32);
    DECLARE @resource nvarchar(255);
    DECLARE @granted int;
    DECLARE ordered_topics CURSOR LOCAL FAST_FORWARD FOR
        SELECT t.topic_id FROM (
            SELECT i.topic_id FROM inserted i LEFT JOIN deleted o ON o.id = i.id
             WHERE i.partition_mode = N'Ordered' AND i.status <> N'Disabled'
               AND (o.id IS NULL OR o.status = N'Disabled' OR o.topic_id <> i.topic_id
                    OR ISNULL(o.filter, N'') <> ISNULL(i.filter, N''))
            UNION
            SELECT o.topic_id FROM inserted i JOIN deleted o ON o.id = i.id
             WHERE i.partition_mode = N'Ordered' AND i.status <> N'Disabled'
               AND o.topic_id <> i.topic_id
        ) AS t ORDER BY t.topic_id;
    OPEN ordered_topics;
    FETCH NEXT FROM ordered_topics INTO @topic_key;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        SET @resource = N'wq-topology:' + LOWER(CONVERT(nchar(36), dbo.wq_text_uuid(@topic_key)));
        EXEC @granted = sys.sp_getapplock
            @Resource = @resource,
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 5000;
        IF @granted < 0
            THROW 51001, N'wq_subscription_ordered_guard: the topology lock was not granted within 5000 ms (error 51001); write again.', 1;
        FETCH NEXT FROM ordered_topics INTO @topic_key;
    END;
    CLOSE ordered_topics;
    DEALLOCATE ordered_topics;
END;
GO

-- wq_publish_one --
-- The body of wq_publish, with its result in OUTPUT parameters so that wq_publish_many can run it
-- once per item without INSERT ... EXEC (which cannot nest and forbids the rollback paths of
-- XACT_ABORT). Same guarantees as wq_publish; runs in its own transaction, nested inside the
-- caller's when there is one.
CREATE OR ALTER PROCEDURE dbo.wq_publish_one
    @topic_name nvarchar(4000),
    @message_id uniqueidentifier,
    @partition_key nvarchar(4000),
    @attributes nvarchar(max),
    @payload nvarchar(max),
    @payload_ref nvarchar(max),
    @correlation_id nvarchar(4000),
    @deduplication_key nvarchar(4000),
    @deduplication_ttl_seconds int,
    @envelope_bytes int,
    @external bit,
    @published_by nvarchar(4000),
    @not_before datetimeoffset(7),
    @delay_seconds int,
    @priority int,
    @out_message_id uniqueidentifier OUTPUT,
    @out_status nvarchar(20) OUTPUT,
    @out_error_code nvarchar(50) OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @message_key char(32) = dbo.wq_uuid_text(@message_id);
    DECLARE @topic_key char(32);
    DECLARE @topic_uuid uniqueidentifier;
    DECLARE @topic_status nvarchar(20);
    DECLARE @transport_status nvarchar(20);
    DECLARE @driver_class nvarchar(100);
    DECLARE @allow_external bit;
    DECLARE @max_payload_bytes int;
    DECLARE @default_ttl int;
    DECLARE @retention_days int;
    DECLARE @due datetimeoffset(7);
    DECLARE @ordinal bigint;
    DECLARE @owner_key char(32);
    DECLARE @owner_status nvarchar(20);
    DECLARE @owner TABLE (message_id char(32));
    DECLARE @inserted TABLE (id char(32));
    DECLARE @same bit;
    DECLARE @id_lock nvarchar(255);
    DECLARE @granted int;

    SET @out_message_id = @message_id;
    SET @out_status = N'Rejected';
    SET @out_error_code = NULL;

    SELECT @topic_key = t.id,
           @topic_status = t.status,
           @transport_status = tr.status,
           @driver_class = tr.driver_class,
           @allow_external = t.allow_external_publish,
           @max_payload_bytes = t.max_payload_bytes,
           @default_ttl = t.default_deduplication_ttl_seconds,
           @retention_days = t.retention_days
      FROM dbo.workqueue_topic AS t
      JOIN dbo.workqueue_transport AS tr ON tr.id = t.transport_id
     WHERE t.name = LOWER(LTRIM(RTRIM(@topic_name)));

    IF @topic_key IS NULL
    BEGIN
        SET @out_error_code = N'TopicNotFound';
        RETURN;
    END;
    -- Another transport's messages do not live in these tables: the caller hands the message
    -- to the topic's own transport (see workqueue.publishing). Variants of the Database
    -- transport (driver class 'Database.<variant>') keep theirs here.
    IF @driver_class <> N'Database' AND @driver_class NOT LIKE N'Database.%'
    BEGIN
        SET @out_error_code = N'TopicOnOtherTransport';
        RETURN;
    END;
    IF @topic_status <> N'Active' OR @transport_status <> N'Active'
    BEGIN
        SET @out_error_code = N'TopicDisabled';
        RETURN;
    END;
    IF @external = 1 AND @allow_external = 0
    BEGIN
        SET @out_error_code = N'TopicNotExternallyPublishable';
        RETURN;
    END;
    -- A key the tables would take for another (SQL Server compares text ignoring trailing
    -- spaces; the column holds 200 code units) would take another key's order lock: refused
    -- with the rest of what the application refuses (review helper-179). DATALENGTH, since
    -- = and LEN() leave trailing spaces out.
    IF @partition_key IS NOT NULL AND (DATALENGTH(@partition_key) = 0
                                       OR DATALENGTH(@partition_key) > 400
                                       OR @partition_key LIKE N'% ')
    BEGIN
        SET @out_error_code = N'InvalidPartitionKey';
        RETURN;
    END;
    IF @priority IS NOT NULL AND (@priority < -100 OR @priority > 100)
    BEGIN
        SET @out_error_code = N'InvalidPriority';
        RETURN;
    END;
    -- The window's bounds are the application's (60 s to 30 days): a shorter or negative one
    -- would switch the key's deduplication off, a longer one hold the key for decades. (A
    -- window without a key holds nothing.)
    -- So is a key the tables would take for another (as a partition key above): its
    -- reservation would never be confirmed, and a duplicate accepted once it lapsed (review
    -- helper-193).
    IF @deduplication_key IS NOT NULL AND (@deduplication_ttl_seconds NOT BETWEEN 60 AND 2592000
                                           OR DATALENGTH(@deduplication_key) = 0
                                           OR DATALENGTH(@deduplication_key) > 400
                                           OR @deduplication_key LIKE N'% ')
    BEGIN
        SET @out_error_code = N'InvalidDeduplication';
        RETURN;
    END;
    IF (@not_before IS NOT NULL AND @delay_seconds IS NOT NULL) OR @delay_seconds < 0
    BEGIN
        SET @out_error_code = N'InvalidSchedule';
        RETURN;
    END;
    -- Due at @not_before (a past time means now) or @delay_seconds from now, at most the
    -- topic's retention ahead: a delivery must not outlive the message retention keeps for it.
    -- Compared in seconds first, so a far-off time cannot overflow DATEADD.
    IF DATEDIFF_BIG(second, @now, COALESCE(@not_before, @now)) + COALESCE(@delay_seconds, 0)
       > CAST(@retention_days AS bigint) * 86400
    BEGIN
        SET @out_error_code = N'InvalidSchedule';
        RETURN;
    END;
    SET @due = DATEADD(second, COALESCE(@delay_seconds, 0),
                       CASE WHEN @not_before > @now THEN @not_before ELSE @now END);
    -- @envelope_bytes is the driver's count under the documented rule: the UTF-8 size of the
    -- canonical envelope (sorted keys, no spaces). SQL Server 2016 cannot count UTF-8, so the
    -- count is trusted only where it exceeds the procedure's own: the canonical envelope of
    -- the text stored, in UTF-16 code units (76 for its keys and punctuation, 4 for a null),
    -- each of which takes at least one UTF-8 byte. A caller that understates the size (or
    -- leaves it out) stores no envelope of more code units than the limit.
    DECLARE @stored_units bigint = 76
        + COALESCE(DATALENGTH(@attributes) / 2, 4)
        + COALESCE(DATALENGTH(@correlation_id) / 2 + 2, 4)
        + COALESCE(DATALENGTH(@partition_key) / 2 + 2, 4)
        + COALESCE(DATALENGTH(@payload) / 2, 4)
        + COALESCE(DATALENGTH(@payload_ref) / 2, 4);
    IF (CASE WHEN @envelope_bytes > @stored_units THEN @envelope_bytes ELSE @stored_units END)
       > CASE WHEN @max_payload_bytes < 262144 THEN @max_payload_bytes ELSE 262144 END
    BEGIN
        SET @out_error_code = N'PayloadTooLarge';
        RETURN;
    END;

    BEGIN TRANSACTION;

    -- Held until commit, so a partition-mode change waits for this fan-out (wq_lock_topology).
    DECLARE @topology_granted int;
    DECLARE @topology_resource nvarchar(255) = N'wq-topology:'
        + LOWER(CONVERT(nchar(36), dbo.wq_text_uuid(@topic_key)));
    EXEC @topology_granted = sys.sp_getapplock
        @Resource = @topology_resource,
        @LockMode = N'Shared',
        @LockOwner = N'Transaction',
        @LockTimeout = 5000;
    IF @topology_granted < 0
        THROW 51001, N'wq_publish: the topology lock was not granted within 5000 ms (error 51001); publish again.', 1;
    -- Granted after a wait (1): a topology change held the lock, a move of the topic to another
    -- transport perhaps, committed by now. The transport read above came before it, so it is
    -- read again (since 0048), or this fan-out wrote deliveries no host would read any more.
    IF @topology_granted = 1 AND NOT EXISTS (
        SELECT 1
          FROM dbo.workqueue_topic AS t
          JOIN dbo.workqueue_transport AS tr ON tr.id = t.transport_id
         WHERE t.id = @topic_key
           AND (tr.driver_class = N'Database' OR tr.driver_class LIKE N'Database.%')
    )
    BEGIN
        SET @out_error_code = N'TopicOnOtherTransport';
        COMMIT TRANSACTION;
        RETURN;
    END;

    -- Ordered subscriptions need a key's ordinals to commit in publish order.
    IF @partition_key IS NOT NULL AND EXISTS (
        SELECT 1
          FROM dbo.workqueue_subscription AS s
         WHERE s.topic_id = @topic_key AND s.partition_mode = N'Ordered'
           AND s.status <> N'Disabled'
           AND (s.[filter] IS NULL OR dbo.wq_filter_matches(s.[filter], @attributes) = 1)
    )
    BEGIN
        SET @topic_uuid = dbo.wq_text_uuid(@topic_key);
        EXEC dbo.wq_lock_publish_order @topic_id = @topic_uuid, @partition_key = @partition_key;
    END;

    IF @deduplication_key IS NOT NULL
    BEGIN
        -- The key's lock first, as a batch takes its keys' (wq_lock_deduplication_key).
        SET @topic_uuid = dbo.wq_text_uuid(@topic_key);
        EXEC dbo.wq_lock_deduplication_key
            @topic_id = @topic_uuid, @deduplication_key = @deduplication_key;
        -- Take the key when it is free, when its window has passed, or when this same message
        -- reserved it before (a retry after a crash); never a confirmed key or another message's
        -- live reservation. The key's lock, held to commit, keeps every other writer of the key
        -- out until then, so the owner read below sees the row as this MERGE left it. (Until
        -- 0052 HOLDLOCK also locked the key ranges around it, and two batches whose keys fell
        -- into the same ranges in opposite orders deadlocked: review helper-160.)
        MERGE dbo.workqueue_deduplication AS x
        USING (SELECT @topic_key AS topic_id, @deduplication_key AS deduplication_key) AS k
           ON x.topic_id = k.topic_id AND x.deduplication_key = k.deduplication_key
        WHEN MATCHED AND (x.expires_at <= @now
                          OR (x.status = N'Reserved' AND x.message_id = @message_key)) THEN
            UPDATE SET message_id = @message_key,
                       status = N'Reserved',
                       expires_at = DATEADD(second, 120, @now)
        WHEN NOT MATCHED THEN
            INSERT (id, topic_id, deduplication_key, message_id, status, expires_at)
            VALUES (LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', '')), @topic_key,
                    @deduplication_key, @message_key, N'Reserved', DATEADD(second, 120, @now))
        OUTPUT inserted.message_id INTO @owner;

        IF NOT EXISTS (SELECT 1 FROM @owner)
        BEGIN
            SELECT @owner_key = x.message_id, @owner_status = x.status
              FROM dbo.workqueue_deduplication AS x
             WHERE x.topic_id = @topic_key AND x.deduplication_key = @deduplication_key
               AND x.expires_at > @now;
            IF @owner_status = N'Confirmed'
            BEGIN
                SET @out_message_id = dbo.wq_text_uuid(@owner_key);
                SET @out_status = N'Duplicate';
            END
            ELSE IF @owner_key IS NOT NULL
                SET @out_error_code = N'DeduplicationPending';
            ELSE
                -- The sweeper purged the row, its window over, between the MERGE and this
                -- read (it takes no key lock): publish again (retryable).
                SET @out_error_code = N'TransportUnavailable';
            COMMIT TRANSACTION;
            RETURN;
        END;
    END;

    -- One publish of a message id at a time, held to commit: the id's own application lock.
    -- Until 0052 a probe under HOLDLOCK locked the key range past the newest id instead, which
    -- every publish of a new (time-ordered) id needs too: every publish waited for the commit
    -- of any transaction that had published, enlisted, however long it ran (review helper-160).
    SET @id_lock = N'wq-message:' + @message_key;
    EXEC @granted = sys.sp_getapplock
        @Resource = @id_lock,
        @LockMode = N'Exclusive',
        @LockOwner = N'Transaction',
        @LockTimeout = 5000;
    IF @granted IN (-1, -3)
        THROW 51001, N'wq_publish: the message id''s lock was not granted within 5000 ms (error 51001); publish again.', 1;
    IF @granted < 0
        THROW 51000, N'wq_publish: sp_getapplock failed (error 51000).', 1;

    SET @ordinal = NEXT VALUE FOR dbo.wq_publish_ordinal_seq;

    INSERT INTO dbo.workqueue_message
           (id, publish_ordinal, topic_id, partition_key, attributes, payload, payload_ref,
            correlation_id, published_at, published_by, published_externally)
    OUTPUT inserted.id INTO @inserted
    SELECT @message_key, @ordinal, @topic_key, @partition_key, @attributes, @payload,
           @payload_ref, @correlation_id, @now, @published_by, ISNULL(@external, 0)
     WHERE NOT EXISTS (SELECT 1 FROM dbo.workqueue_message AS m WHERE m.id = @message_key);

    IF NOT EXISTS (SELECT 1 FROM @inserted)
    BEGIN
        -- The id is taken. Undo this call's own reservation; nobody else can see it yet.
        IF @deduplication_key IS NOT NULL
            DELETE x
              FROM dbo.workqueue_deduplication AS x
             WHERE x.topic_id = @topic_key AND x.deduplication_key = @deduplication_key
               AND x.message_id = @message_key AND x.status = N'Reserved';

        -- Same topic and the same canonical envelope (the driver sends JSON with sorted keys, so
        -- equal text means equal JSON; compared byte for byte, lengths included) = Duplicate.
        SELECT @same = CASE
            WHEN m.topic_id = @topic_key
             AND ((m.partition_key IS NULL AND @partition_key IS NULL)
                  OR (m.partition_key = @partition_key
                      AND DATALENGTH(m.partition_key) = DATALENGTH(@partition_key)))
             AND ((m.attributes IS NULL AND @attributes IS NULL)
                  OR (m.attributes COLLATE Latin1_General_100_BIN2 = @attributes
                      AND DATALENGTH(m.attributes) = DATALENGTH(@attributes)))
             AND ((m.payload IS NULL AND @payload IS NULL)
                  OR (m.payload COLLATE Latin1_General_100_BIN2 = @payload
                      AND DATALENGTH(m.payload) = DATALENGTH(@payload)))
             AND ((m.payload_ref IS NULL AND @payload_ref IS NULL)
                  OR (m.payload_ref COLLATE Latin1_General_100_BIN2 = @payload_ref
                      AND DATALENGTH(m.payload_ref) = DATALENGTH(@payload_ref)))
             AND ((m.correlation_id IS NULL AND @correlation_id IS NULL)
                  OR (m.correlation_id COLLATE Latin1_General_100_BIN2 = @correlation_id
                      AND DATALENGTH(m.correlation_id) = DATALENGTH(@correlation_id)))
            THEN 1 ELSE 0 END
          FROM dbo.workqueue_message AS m
         WHERE m.id = @message_key;

        IF @same IS NULL
            -- Purged between the insert and this read; the caller may retry.
            SET @out_error_code = N'TransportUnavailable';
        ELSE IF @same = 1
            SET @out_status = N'Duplicate';
        ELSE
            SET @out_error_code = N'MessageIDConflict';
        COMMIT TRANSACTION;
        RETURN;
    END;

    INSERT INTO dbo.workqueue_delivery
           (id, message_id, subscription_id, status, partition_key, order_key, attempt_count,
            is_replay, visible_at, priority)
    SELECT LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', '')), @message_key, s.id, N'Pending',
           CASE WHEN s.partition_mode <> N'None' THEN @partition_key END,
           @ordinal, 0, 0, @due, COALESCE(@priority, 0)
      FROM dbo.workqueue_subscription AS s
     WHERE s.topic_id = @topic_key AND s.status <> N'Disabled'
       -- Most subscriptions have no filter: they skip the scalar function, called per row
       -- otherwise (dbo.wq_filter_matches(NULL, ...) is 1).
       AND (s.[filter] IS NULL OR dbo.wq_filter_matches(s.[filter], @attributes) = 1);

    IF @deduplication_key IS NOT NULL
        UPDATE x
           SET status = N'Confirmed',
               expires_at = DATEADD(second, COALESCE(@deduplication_ttl_seconds, @default_ttl), @now)
          FROM dbo.workqueue_deduplication AS x
         WHERE x.topic_id = @topic_key AND x.deduplication_key = @deduplication_key
           AND x.message_id = @message_key;

    COMMIT TRANSACTION;
    SET @out_status = N'Accepted';
END;
GO

-- wq_publish --
-- Publish one message in one call and one transaction. Returns exactly one row: the message id
-- (for a Duplicate by deduplication key, the id of the message that owns the key), the status
-- Accepted | Duplicate | Rejected, and an error code for rejections (TopicNotFound,
-- TopicOnOtherTransport for a topic on a transport other than Database.*, TopicDisabled,
-- TopicNotExternallyPublishable, InvalidPriority, InvalidSchedule, PayloadTooLarge,
-- DeduplicationPending, MessageIDConflict, TransportUnavailable). The deliveries are due at
-- @not_before or @delay_seconds from now (one or neither, at most the topic's retention ahead)
-- and carry @priority (-100..100, NULL means 0) for wq_claim.
-- Nothing is written unless the status is Accepted;
-- a re-publish of an existing id with the same canonical envelope is a Duplicate.
-- @external and @published_by are the application's word (whether the message came in over the
-- REST API, and as whom): the database sees only the login that holds grant-runtime, which may
-- publish internally anyway, so claiming "not external" gains a caller nothing.
-- @caller_announces is PostgreSQL's (whether the caller announces the publish itself once it
-- has committed, instead of a NOTIFY at commit); SQL Server has no notifications, so it is
-- accepted and ignored.
-- returns: message_id, status, error_code
CREATE OR ALTER PROCEDURE dbo.wq_publish
    @topic_name nvarchar(4000),
    @message_id uniqueidentifier,
    @partition_key nvarchar(4000),
    @attributes nvarchar(max),
    @payload nvarchar(max),
    @payload_ref nvarchar(max),
    @correlation_id nvarchar(4000),
    @deduplication_key nvarchar(4000),
    @deduplication_ttl_seconds int,
    @envelope_bytes int,
    @external bit,
    @published_by nvarchar(4000),
    @not_before datetimeoffset(7),
    @delay_seconds int,
    @priority int,
    @caller_announces bit = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @result_id uniqueidentifier;
    DECLARE @result_status nvarchar(20);
    DECLARE @result_error nvarchar(50);

    EXEC dbo.wq_publish_one
        @topic_name = @topic_name,
        @message_id = @message_id,
        @partition_key = @partition_key,
        @attributes = @attributes,
        @payload = @payload,
        @payload_ref = @payload_ref,
        @correlation_id = @correlation_id,
        @deduplication_key = @deduplication_key,
        @deduplication_ttl_seconds = @deduplication_ttl_seconds,
        @envelope_bytes = @envelope_bytes,
        @external = @external,
        @published_by = @published_by,
        @not_before = @not_before,
        @delay_seconds = @delay_seconds,
        @priority = @priority,
        @out_message_id = @result_id OUTPUT,
        @out_status = @result_status OUTPUT,
        @out_error_code = @result_error OUTPUT;

    -- result set
    SELECT @result_id AS message_id, @result_status AS status, @result_error AS error_code;
END;
GO

-- wq_publish_many --
-- Publish a JSON array of messages (objects with the wq_publish parameters as keys) to one topic
-- in one transaction, in array order. The ordered-publish locks of every key in the batch are
-- taken first, in binary key order, so two batches sharing keys cannot deadlock on them. Returns
-- one row per item with its zero-based position; each item is accepted or rejected on its own.
-- Item JSON values are stored as the canonical text they arrive in.
-- @caller_announces is accepted and ignored, as for wq_publish.
-- returns: item_index, message_id, status, error_code
CREATE OR ALTER PROCEDURE dbo.wq_publish_many
    @topic_name nvarchar(4000),
    @messages nvarchar(max),
    @external bit,
    @published_by nvarchar(4000),
    @caller_announces bit = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @topic_key char(32);
    DECLARE @topic_uuid uniqueidentifier;
    DECLARE @key_ord int = 0;
    DECLARE @key nvarchar(4000);
    DECLARE @index int = -1;
    DECLARE @next int;
    DECLARE @message_id uniqueidentifier;
    DECLARE @partition_key nvarchar(4000);
    DECLARE @attributes nvarchar(max);
    DECLARE @payload nvarchar(max);
    DECLARE @payload_ref nvarchar(max);
    DECLARE @correlation_id nvarchar(4000);
    DECLARE @deduplication_key nvarchar(4000);
    DECLARE @deduplication_ttl_seconds int;
    DECLARE @envelope_bytes int;
    DECLARE @not_before datetimeoffset(7);
    DECLARE @delay_seconds int;
    DECLARE @priority int;
    DECLARE @result_id uniqueidentifier;
    DECLARE @result_status nvarchar(20);
    DECLARE @result_error nvarchar(50);
    DECLARE @items TABLE (
        item_index int PRIMARY KEY,
        message_id uniqueidentifier,
        partition_key nvarchar(4000) COLLATE Latin1_General_100_BIN2,
        attributes nvarchar(max),
        payload nvarchar(max),
        payload_ref nvarchar(max),
        correlation_id nvarchar(4000),
        deduplication_key nvarchar(4000),
        deduplication_ttl_seconds int,
        envelope_bytes int,
        not_before datetimeoffset(7),
        delay_seconds int,
        priority int
    );
    DECLARE @keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        lock_key nvarchar(4000) COLLATE Latin1_General_100_BIN2
    );
    DECLARE @results TABLE (
        item_index int PRIMARY KEY,
        message_id uniqueidentifier,
        status nvarchar(20),
        error_code nvarchar(50)
    );

    -- The payload may be any JSON value. Objects and arrays arrive as their own text; a string is
    -- re-escaped the way the driver's canonical JSON writes it (STRING_ESCAPE also escapes '/',
    -- which canonical JSON leaves alone); numbers and booleans keep their literal text.
    INSERT INTO @items
           (item_index, message_id, partition_key, attributes, payload, payload_ref,
            correlation_id, deduplication_key, deduplication_ttl_seconds, envelope_bytes,
            not_before, delay_seconds, priority)
    SELECT CAST(e.[key] AS int), j.message_id, j.partition_key, j.attributes,
           CASE p.[type]
               WHEN 0 THEN NULL
               WHEN 1 THEN N'"' + REPLACE(STRING_ESCAPE(p.[value], 'json'), N'\/', N'/') + N'"'
               ELSE p.[value]
           END,
           j.payload_ref, j.correlation_id, j.deduplication_key, j.deduplication_ttl_seconds,
           j.envelope_bytes, j.not_before, j.delay_seconds, j.priority
      FROM OPENJSON(@messages) AS e
     CROSS APPLY OPENJSON(e.[value])
           WITH (
               message_id uniqueidentifier '$.message_id',
               partition_key nvarchar(4000) '$.partition_key',
               attributes nvarchar(max) '$.attributes' AS JSON,
               payload_ref nvarchar(max) '$.payload_ref' AS JSON,
               correlation_id nvarchar(4000) '$.correlation_id',
               deduplication_key nvarchar(4000) '$.deduplication_key',
               deduplication_ttl_seconds int '$.deduplication_ttl_seconds',
               envelope_bytes int '$.envelope_bytes',
               not_before datetimeoffset(7) '$.not_before',
               delay_seconds int '$.delay_seconds',
               priority int '$.priority'
           ) AS j
     OUTER APPLY (
           SELECT v.[value], v.[type] FROM OPENJSON(e.[value]) AS v WHERE v.[key] = N'payload'
     ) AS p;

    BEGIN TRANSACTION;

    SELECT @topic_key = t.id FROM dbo.workqueue_topic AS t WHERE t.name = LOWER(LTRIM(RTRIM(@topic_name)));
    IF @topic_key IS NOT NULL
    BEGIN
        -- Held until commit, as each item's wq_publish_one holds it, and taken before the Ordered
        -- check: a change to Ordered that commits after the check and before the fan-out would
        -- otherwise get deliveries whose key was never locked, and a later publish of that key
        -- could commit its ordinal first.
        DECLARE @topology_granted int;
        DECLARE @topology_resource nvarchar(255) = N'wq-topology:'
            + LOWER(CONVERT(nchar(36), dbo.wq_text_uuid(@topic_key)));
        EXEC @topology_granted = sys.sp_getapplock
            @Resource = @topology_resource,
            @LockMode = N'Shared',
            @LockOwner = N'Transaction',
            @LockTimeout = 5000;
        IF @topology_granted < 0
            THROW 51001, N'wq_publish_many: the topology lock was not granted within 5000 ms (error 51001); publish again.', 1;
    END;
    IF @topic_key IS NOT NULL AND EXISTS (
        SELECT 1
          FROM dbo.workqueue_subscription AS s
         WHERE s.topic_id = @topic_key AND s.partition_mode = N'Ordered' AND s.status <> N'Disabled'
    )
    BEGIN
        SET @topic_uuid = dbo.wq_text_uuid(@topic_key);
        INSERT INTO @keys (lock_key)
        SELECT DISTINCT i.partition_key FROM @items AS i
         WHERE i.partition_key IS NOT NULL
         ORDER BY i.partition_key;
        WHILE 1 = 1
        BEGIN
            SET @key = NULL;
            SELECT TOP (1) @key_ord = k.ord, @key = k.lock_key
              FROM @keys AS k WHERE k.ord > @key_ord ORDER BY k.ord;
            IF @key IS NULL
                BREAK;
            EXEC dbo.wq_lock_publish_order @topic_id = @topic_uuid, @partition_key = @key;
        END;
    END;
    -- The deduplication keys' locks next, likewise sorted (until 0044 the keys were reserved
    -- in list order only: batches sharing keys in other orders deadlocked). Their rows follow
    -- the partition keys' in @keys, so the walk goes on from where that one stopped.
    IF @topic_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM @items AS i WHERE i.deduplication_key IS NOT NULL
    )
    BEGIN
        SET @topic_uuid = dbo.wq_text_uuid(@topic_key);
        INSERT INTO @keys (lock_key)
        SELECT DISTINCT i.deduplication_key COLLATE Latin1_General_100_BIN2 FROM @items AS i
         WHERE i.deduplication_key IS NOT NULL
         ORDER BY 1;
        WHILE 1 = 1
        BEGIN
            SET @key = NULL;
            SELECT TOP (1) @key_ord = k.ord, @key = k.lock_key
              FROM @keys AS k WHERE k.ord > @key_ord ORDER BY k.ord;
            IF @key IS NULL
                BREAK;
            EXEC dbo.wq_lock_deduplication_key @topic_id = @topic_uuid, @deduplication_key = @key;
        END;
    END;

    WHILE 1 = 1
    BEGIN
        SET @next = NULL;
        SELECT TOP (1)
               @next = i.item_index,
               @message_id = i.message_id,
               @partition_key = i.partition_key,
               @attributes = i.attributes,
               @payload = i.payload,
               @payload_ref = i.payload_ref,
               @correlation_id = i.correlation_id,
               @deduplication_key = i.deduplication_key,
               @deduplication_ttl_seconds = i.deduplication_ttl_seconds,
               @envelope_bytes = i.envelope_bytes,
               @not_before = i.not_before,
               @delay_seconds = i.delay_seconds,
               @priority = i.priority
          FROM @items AS i
         WHERE i.item_index > @index
         ORDER BY i.item_index;
        IF @next IS NULL
            BREAK;
        SET @index = @next;

        EXEC dbo.wq_publish_one
            @topic_name = @topic_name,
            @message_id = @message_id,
            @partition_key = @partition_key,
            @attributes = @attributes,
            @payload = @payload,
            @payload_ref = @payload_ref,
            @correlation_id = @correlation_id,
            @deduplication_key = @deduplication_key,
            @deduplication_ttl_seconds = @deduplication_ttl_seconds,
            @envelope_bytes = @envelope_bytes,
            @external = @external,
            @published_by = @published_by,
            @not_before = @not_before,
            @delay_seconds = @delay_seconds,
            @priority = @priority,
            @out_message_id = @result_id OUTPUT,
            @out_status = @result_status OUTPUT,
            @out_error_code = @result_error OUTPUT;

        INSERT INTO @results (item_index, message_id, status, error_code)
        VALUES (@index, @result_id, @result_status, @result_error);
    END;

    COMMIT TRANSACTION;

    -- result set
    SELECT r.item_index, r.message_id, r.status, r.error_code
      FROM @results AS r
     ORDER BY r.item_index;
END;
GO

-- wq_reserve_deduplication --
-- Reserve a topic's deduplication key for a message a transport outside these tables is about
-- to send (the AWS transport): the first step of reserve, send, confirm (or release). Returns
-- one row: status Reserved (this message holds the key for 120 s), Duplicate (a confirmed
-- owner holds it; owner_message_id names it, this message's own id when it was confirmed
-- before), Pending (another message's live reservation holds it: publish again shortly) or
-- TopicNotFound. The key is taken as wq_publish takes it: when free, when its window has
-- passed, or when this same message reserved it before (a retry after a crash).
-- returns: status, owner_message_id
CREATE OR ALTER PROCEDURE dbo.wq_reserve_deduplication
    @topic_name nvarchar(4000),
    @deduplication_key nvarchar(4000),
    @message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @message_key char(32) = dbo.wq_uuid_text(@message_id);
    DECLARE @topic_key char(32);
    DECLARE @owner TABLE (message_id char(32));
    DECLARE @owner_key char(32);
    DECLARE @owner_status nvarchar(20);
    DECLARE @status nvarchar(20);
    DECLARE @topic_uuid uniqueidentifier;

    -- A key the tables would take for another could never be confirmed (wq_publish).
    IF DATALENGTH(@deduplication_key) = 0 OR DATALENGTH(@deduplication_key) > 400
       OR @deduplication_key LIKE N'% '
        THROW 51002, N'wq_reserve_deduplication: the deduplication key is empty, ends with a space or is longer than 200 characters (error 51002).', 1;

    SELECT @topic_key = t.id
      FROM dbo.workqueue_topic AS t
     WHERE t.name = LOWER(LTRIM(RTRIM(@topic_name)));

    IF @topic_key IS NULL
        SET @status = N'TopicNotFound';
    ELSE
    BEGIN
        BEGIN TRANSACTION;
        -- The key's lock, as wq_publish takes it, held to commit: the owner read below sees
        -- the row as this MERGE left it (until 0052 HOLDLOCK locked the key ranges around it).
        SET @topic_uuid = dbo.wq_text_uuid(@topic_key);
        EXEC dbo.wq_lock_deduplication_key
            @topic_id = @topic_uuid, @deduplication_key = @deduplication_key;
        MERGE dbo.workqueue_deduplication AS x
        USING (
            SELECT @topic_key AS topic_id, @deduplication_key AS deduplication_key
        ) AS k
            ON x.topic_id = k.topic_id AND x.deduplication_key = k.deduplication_key
        WHEN MATCHED AND (
            x.expires_at <= @now OR (x.status = N'Reserved' AND x.message_id = @message_key)
        ) THEN
            UPDATE SET
                message_id = @message_key,
                status = N'Reserved',
                expires_at = DATEADD(second, 120, @now)
        WHEN NOT MATCHED THEN
            INSERT (id, topic_id, deduplication_key, message_id, status, expires_at) VALUES (
                LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', '')),
                @topic_key,
                @deduplication_key,
                @message_key,
                N'Reserved',
                DATEADD(second, 120, @now)
            )
        OUTPUT inserted.message_id INTO @owner;

        IF EXISTS (SELECT 1 FROM @owner)
        BEGIN
            SET @status = N'Reserved';
            SET @owner_key = @message_key;
        END
        ELSE
        BEGIN
            SELECT @owner_key = x.message_id, @owner_status = x.status
              FROM dbo.workqueue_deduplication AS x
             WHERE x.topic_id = @topic_key
               AND x.deduplication_key = @deduplication_key
               AND x.expires_at > @now;
            -- No owner: the sweeper purged the row, its window just over, after the MERGE
            -- (it takes no key lock); Pending asks for the reservation again.
            SET @status = CASE WHEN @owner_status = N'Confirmed' THEN N'Duplicate'
                               ELSE N'Pending' END;
        END;
        COMMIT TRANSACTION;
    END;

    -- result set
    SELECT @status AS status, dbo.wq_text_uuid(@owner_key) AS owner_message_id;
END;
GO

-- wq_confirm_deduplication --
-- The message that reserved a deduplication key was sent: hold the key for
-- @deduplication_ttl_seconds (NULL: the topic's default; else at least 60 s; a message id's
-- own entry is held for the topic's retention, which may pass 30 days) from now. Affects one
-- row, or none when the reservation is no longer this message's (it lapsed and another
-- publish took it) or the window is under a minute. Only a reservation is confirmed:
-- a confirmed key keeps the window it was given, or any caller that knows its message id
-- could shorten it (and let the message be published, and delivered, again).
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_confirm_deduplication
    @topic_name nvarchar(4000),
    @deduplication_key nvarchar(4000),
    @message_id uniqueidentifier,
    @deduplication_ttl_seconds int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @changed TABLE (id char(32));

    UPDATE x
       SET status = N'Confirmed',
           expires_at = DATEADD(
               second, COALESCE(@deduplication_ttl_seconds, t.default_deduplication_ttl_seconds), @now
           )
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_deduplication AS x
      JOIN dbo.workqueue_topic AS t ON t.id = x.topic_id
     WHERE t.name = LOWER(LTRIM(RTRIM(@topic_name)))
       AND x.deduplication_key = @deduplication_key
       AND x.message_id = dbo.wq_uuid_text(@message_id)
       AND x.status = N'Reserved'
       AND (@deduplication_ttl_seconds IS NULL OR @deduplication_ttl_seconds >= 60);

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_release_deduplication --
-- Sending the message that reserved a deduplication key failed: free the key at once, so a
-- retry need not wait out the reservation. Only this message's reservation is removed (never a
-- confirmed key); affects one row or none.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_release_deduplication
    @topic_name nvarchar(4000),
    @deduplication_key nvarchar(4000),
    @message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @changed TABLE (id char(32));

    DELETE x
    OUTPUT deleted.id INTO @changed
      FROM dbo.workqueue_deduplication AS x
      JOIN dbo.workqueue_topic AS t ON t.id = x.topic_id
     WHERE t.name = LOWER(LTRIM(RTRIM(@topic_name)))
       AND x.deduplication_key = @deduplication_key
       AND x.message_id = dbo.wq_uuid_text(@message_id)
       AND x.status = N'Reserved';

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_announce --
-- PostgreSQL wakes a topic's listening hosts here once a publish made with @caller_announces
-- has committed (with @message_ids, only the consumers of the subscriptions that got
-- deliveries). SQL Server has no notifications (hosts poll), so this announces nothing.
-- returns: announced
CREATE OR ALTER PROCEDURE dbo.wq_announce
    @topic_name nvarchar(4000),
    @message_ids nvarchar(max) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    -- result set
    SELECT CAST(0 AS bit) AS announced;
END;
GO
