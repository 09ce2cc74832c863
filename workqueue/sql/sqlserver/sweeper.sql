-- Sweeper: lease expiry across all subscriptions and retention purges, in bounded batches that
-- skip rows other sessions hold locked (READPAST). One pass at a time across all hosts: the
-- sweeper holds wq_try_sweep_lock's row lock, owned by its transaction, on a private connection
-- while it runs the steps on another. Each step clamps its batch to 1..5000 (NULL: 1000), as
-- the bulk operator procedures do: any role granted the steps passes its own batch size
-- (review helper-173).

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_expire_leases_all --
-- wq_expire_leases for every subscription at once (each with its own max_attempts), at most
-- @batch_size rows, oldest expiry first. Returns every changed row with its new status. Also
-- clears up to as many passed key holds nobody let go of (below).
-- returns: delivery_id, subscription_id, partition_key, new_status
CREATE OR ALTER PROCEDURE dbo.wq_expire_leases_all
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET @batch_size = CASE WHEN @batch_size IS NULL THEN 1000
                           WHEN @batch_size > 5000 THEN 5000
                           WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @changed TABLE (
        id char(32),
        subscription_id char(32),
        partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2,
        new_status nvarchar(20)
    );

    UPDATE d
       SET status = CASE WHEN d.cancel_requested_at IS NOT NULL THEN N'Discarded'
                         WHEN d.attempt_count < s.max_attempts THEN N'Pending'
                         ELSE N'DeadLettered' END,
           visible_at = CASE WHEN d.cancel_requested_at IS NULL AND d.attempt_count < s.max_attempts
                             THEN @now ELSE d.visible_at END,
           completed_at = CASE WHEN d.cancel_requested_at IS NOT NULL THEN @now
                               ELSE d.completed_at END,
           last_error = CASE WHEN d.cancel_requested_at IS NOT NULL THEN d.last_error
                             ELSE N'LeaseExpired' END,
           dead_letter_reason = CASE WHEN d.cancel_requested_at IS NULL
                                      AND d.attempt_count >= s.max_attempts
                                     THEN N'LeaseExpired' ELSE d.dead_letter_reason END,
           dead_lettered_at = CASE WHEN d.cancel_requested_at IS NULL
                                    AND d.attempt_count >= s.max_attempts
                                   THEN @now ELSE d.dead_lettered_at END,
           lease_owner = NULL,
           lease_token = NULL,
           lease_expires_at = NULL
    OUTPUT inserted.id, inserted.subscription_id, inserted.partition_key, inserted.status
      INTO @changed
      FROM dbo.workqueue_delivery AS d
      JOIN dbo.workqueue_subscription AS s ON s.id = d.subscription_id
     WHERE d.id IN (
               SELECT TOP (@batch_size) x.id
                 FROM dbo.workqueue_delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE x.status = N'InFlight' AND x.lease_expires_at < @now
                ORDER BY x.lease_expires_at)
       AND d.status = N'InFlight' AND d.lease_expires_at < @now;

    -- Passed key holds (wq_complete_holding_key) that nobody let go of (a host that died, a
    -- release that failed): the key has been free since, and the completed row would go on
    -- naming a lease holder.
    UPDATE d
       SET lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
      FROM dbo.workqueue_delivery AS d
     WHERE d.id IN (
               SELECT TOP (@batch_size) k.id
                 FROM dbo.workqueue_delivery AS k WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE k.status = N'Completed' AND k.lease_expires_at < @now)
       AND d.status = N'Completed' AND d.lease_expires_at < @now;

    -- result set
    SELECT dbo.wq_text_uuid(c.id) AS delivery_id,
           dbo.wq_text_uuid(c.subscription_id) AS subscription_id,
           c.partition_key,
           c.new_status
      FROM @changed AS c;
END;
GO

-- wq_purge_terminal_deliveries --
-- Delete up to @batch_size Completed/Discarded deliveries whose completed_at is older than their
-- topic's retention_days. Dead letters are never purged: they wait for an operator; nor is a
-- completed delivery whose handler still holds its partition key (wq_complete_holding_key).
-- Subscription by subscription, each along wq_dlv_settled_ix up to its own topic's cutoff: until
-- 0048 every subscription's were read in one order of age, so each batch read all the settled
-- deliveries that topics with a longer retention than the shortest still keep.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_purge_terminal_deliveries
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET @batch_size = CASE WHEN @batch_size IS NULL THEN 1000
                           WHEN @batch_size > 5000 THEN 5000
                           WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @deleted TABLE (id char(32));

    DELETE d
    OUTPUT deleted.id INTO @deleted
      FROM dbo.workqueue_delivery AS d
     WHERE d.id IN (
               SELECT TOP (@batch_size) v.id
                 FROM dbo.workqueue_subscription AS s
                 JOIN dbo.workqueue_topic AS t ON t.id = s.topic_id
                CROSS APPLY (
                    SELECT TOP (@batch_size) x.id
                      FROM dbo.workqueue_delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
                     WHERE x.subscription_id = s.id
                       AND x.status IN (N'Completed', N'Discarded')
                       AND x.completed_at < DATEADD(day, -t.retention_days, @now)
                       -- A hold still live: its handler runs on (review helper-199).
                       AND NOT (x.status = N'Completed' AND x.lease_expires_at IS NOT NULL
                                AND x.lease_expires_at > @now)
                     ORDER BY x.completed_at) AS v)
       AND d.status IN (N'Completed', N'Discarded');

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @deleted;
END;
GO

-- wq_purge_orphan_messages --
-- Delete up to @batch_size messages older than their topic's retention that no delivery refers
-- to any more (every delivery was purged, or the publish matched no subscription).
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_purge_orphan_messages
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET @batch_size = CASE WHEN @batch_size IS NULL THEN 1000
                           WHEN @batch_size > 5000 THEN 5000
                           WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @deleted TABLE (id char(32));

    DELETE m
    OUTPUT deleted.id INTO @deleted
      FROM dbo.workqueue_message AS m
     WHERE m.id IN (
               SELECT TOP (@batch_size) x.id
                 FROM dbo.workqueue_message AS x WITH (UPDLOCK, READPAST, ROWLOCK)
                 JOIN dbo.workqueue_topic AS t ON t.id = x.topic_id
                WHERE x.published_at < DATEADD(day, -t.retention_days, @now)
                  AND NOT EXISTS (
                      SELECT 1 FROM dbo.workqueue_delivery AS d WHERE d.message_id = x.id))
       AND NOT EXISTS (SELECT 1 FROM dbo.workqueue_delivery AS d WHERE d.message_id = m.id);

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @deleted;
END;
GO

-- wq_purge_expired_deduplications --
-- Delete up to @batch_size deduplication ledger rows whose window has passed.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_purge_expired_deduplications
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET @batch_size = CASE WHEN @batch_size IS NULL THEN 1000
                           WHEN @batch_size > 5000 THEN 5000
                           WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @deleted TABLE (id char(32));

    DELETE TOP (@batch_size) x
    OUTPUT deleted.id INTO @deleted
      FROM dbo.workqueue_deduplication AS x WITH (READPAST, ROWLOCK)
     WHERE x.expires_at <= @now;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @deleted;
END;
GO

-- wq_try_sweep_lock --
-- Try, without waiting, to take the cluster-wide sweep lock: the one row of workqueue_sweep_lock,
-- update-locked until the caller's transaction ends. acquired = 0 means another sweeper is
-- mid-pass; skip this one. A row lock, not an application lock (until 0044): any user may call
-- sp_getapplock, and a session that is no sweeper holding the lock stopped every pass; no granted
-- role may read or lock this table. Must be called inside a transaction (raises 51000
-- otherwise), since a lock owned by a statement's own transaction would be gone before the
-- caller could use it.
-- returns: acquired
CREATE OR ALTER PROCEDURE dbo.wq_try_sweep_lock
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @acquired bit = 0;

    IF @@TRANCOUNT = 0
        THROW 51000, N'wq_try_sweep_lock must run inside the transaction that holds the sweep lock (error 51000).', 1;

    SELECT @acquired = 1
      FROM dbo.workqueue_sweep_lock WITH (UPDLOCK, ROWLOCK, READPAST)
     WHERE id = 1;

    IF @acquired = 0
    BEGIN
        -- Held by another sweeper, or gone (a `flush` empties every table): put it back, and
        -- then it is this transaction's. A sweeper putting it back right now keeps it: this
        -- one waits at most 50 ms for it (error 1222) or finds its key taken (2627), and skips
        -- its pass, rather than wait for the other's pass to end. Both errors end only the
        -- statement once XACT_ABORT is off (both settings end with the procedure).
        SET XACT_ABORT OFF;
        SET LOCK_TIMEOUT 50;
        BEGIN TRY
            INSERT INTO dbo.workqueue_sweep_lock (id)
            SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM dbo.workqueue_sweep_lock WHERE id = 1);
            IF @@ROWCOUNT = 1
                SET @acquired = 1;
        END TRY
        BEGIN CATCH
            IF ERROR_NUMBER() NOT IN (1222, 2601, 2627) OR XACT_STATE() <> 1
                THROW;
        END CATCH;
    END;

    -- result set
    SELECT @acquired AS acquired;
END;
GO
