-- Claiming: lease expiry for one subscription and the batch claim that hands deliveries to a
-- consumer. Every claim is a guarded UPDATE; the filtered unique index wq_delivery_inflight_key_uq
-- on (subscription_id, partition_key) WHERE status = 'InFlight' is the final word on single
-- flight per key, whatever the isolation level shows the re-checks.

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_expire_leases --
-- Settle up to @batch_size InFlight deliveries of one subscription whose lease has passed, oldest
-- expiry first, skipping rows another session holds locked: a cancelled one becomes Discarded
-- (completed now, last_error kept), one with attempts left becomes Pending again (visible now,
-- no backoff, last_error 'LeaseExpired'), one on its last attempt becomes DeadLettered with
-- reason 'LeaseExpired'. The lease columns are cleared in every case. Returns every row it
-- changed with its new status.
-- returns: delivery_id, subscription_id, partition_key, new_status
CREATE OR ALTER PROCEDURE dbo.wq_expire_leases
    @subscription_id uniqueidentifier,
    @batch_size int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
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
                  AND x.subscription_id = @subscription_key
                ORDER BY x.lease_expires_at)
       AND d.status = N'InFlight' AND d.lease_expires_at < @now;

    -- result set
    SELECT dbo.wq_text_uuid(c.id) AS delivery_id,
           dbo.wq_text_uuid(c.subscription_id) AS subscription_id,
           c.partition_key,
           c.new_status
      FROM @changed AS c;
END;
GO

-- wq_claim --
-- Lease up to @max_rows deliveries of an Active subscription to @lease_owner in one call.
-- First expires this subscription's passed leases (up to 500); rows of kind 'ExpiredDeadLetter'
-- report the ones that were dead-lettered. Partitioned subscriptions then claim at most one
-- delivery per key, oldest visible first, each with its own guarded UPDATE that re-checks every
-- rule (Exclusive: nothing of the key in flight; Ordered: also no earlier Pending, InFlight or
-- DeadLettered delivery of the key); a unique-index violation (2601/2627) means another consumer
-- won that key, and only that candidate is skipped. Remaining capacity goes to keyless
-- deliveries, claimed in one skip-locked batch (UPDLOCK, READPAST, ROWLOCK). Each claim sets a
-- fresh lease token, lease_expires_at = now + lease_seconds, last_heartbeat_at = now,
-- attempt_count + 1 and clears progress. Rows of kind 'Claimed' come in claim order.
-- Call it outside a transaction: inside one, a lost key race dooms the caller's transaction and
-- is raised instead of skipped. It runs wq_expire_leases through INSERT ... EXEC, so it cannot
-- itself be the target of an INSERT ... EXEC.
-- returns: kind, delivery_id, lease_token, lease_expires_at, attempt_count, is_replay, message_id, topic_id, partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE dbo.wq_claim
    @subscription_id uniqueidentifier,
    @lease_owner nvarchar(4000),
    @max_rows int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @partition_mode nvarchar(20);
    DECLARE @lease_seconds int;
    DECLARE @subscription_status nvarchar(20);
    DECLARE @ordered bit;
    DECLARE @remaining int = @max_rows;
    DECLARE @ord int = 0;
    DECLARE @candidate char(32);
    DECLARE @expired TABLE (
        delivery_id uniqueidentifier,
        subscription_id uniqueidentifier,
        partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2,
        new_status nvarchar(20)
    );
    DECLARE @candidates TABLE (
        ord int PRIMARY KEY,
        id char(32),
        partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2,
        first_of_key bit
    );
    DECLARE @claimed TABLE (
        id char(32),
        message_id char(32),
        lease_token char(32),
        lease_expires_at datetimeoffset(7),
        attempt_count int,
        is_replay bit,
        visible_at datetimeoffset(7)
    );
    DECLARE @result TABLE (
        seq int IDENTITY(1, 1) PRIMARY KEY,
        phase tinyint,
        sort_at datetimeoffset(7),
        kind nvarchar(20),
        delivery_id uniqueidentifier,
        lease_token uniqueidentifier,
        lease_expires_at datetimeoffset(7),
        attempt_count int,
        is_replay bit,
        message_id uniqueidentifier,
        topic_id uniqueidentifier,
        partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2,
        attributes nvarchar(max),
        payload nvarchar(max),
        payload_ref nvarchar(max),
        correlation_id nvarchar(200),
        published_at datetimeoffset(7)
    );

    -- A cheap probe of the lease index first: most claims find no passed lease, and then the
    -- expiry statement (row locks, a write) is skipped.
    IF EXISTS (
        SELECT 1 FROM dbo.workqueue_delivery AS x
         WHERE x.status = N'InFlight' AND x.lease_expires_at < @now
           AND x.subscription_id = @subscription_key
    )
        INSERT INTO @expired (delivery_id, subscription_id, partition_key, new_status)
        EXEC dbo.wq_expire_leases @subscription_id = @subscription_id, @batch_size = 500;

    INSERT INTO @result (phase, kind, delivery_id, partition_key)
    SELECT 1, N'ExpiredDeadLetter', e.delivery_id, e.partition_key
      FROM @expired AS e
     WHERE e.new_status = N'DeadLettered';

    SELECT @partition_mode = s.partition_mode,
           @lease_seconds = s.lease_seconds,
           @subscription_status = s.status
      FROM dbo.workqueue_subscription AS s
     WHERE s.id = @subscription_key;
    SET @ordered = CASE WHEN @partition_mode = N'Ordered' THEN 1 ELSE 0 END;

    IF @subscription_status = N'Active' AND @max_rows >= 1
    BEGIN
        IF @partition_mode <> N'None'
        BEGIN
            -- Read-only candidate list; the claim statement below re-checks every rule.
            INSERT INTO @candidates (ord, id, partition_key, first_of_key)
            SELECT c.ord, c.id, c.partition_key,
                   CASE WHEN ROW_NUMBER() OVER (PARTITION BY c.partition_key ORDER BY c.ord) = 1
                        THEN 1 ELSE 0 END
              FROM (
                    SELECT TOP (@max_rows * 4)
                           d.id, d.partition_key,
                           ROW_NUMBER() OVER (ORDER BY d.visible_at, d.order_key) AS ord
                      FROM dbo.workqueue_delivery AS d
                     WHERE d.subscription_id = @subscription_key AND d.status = N'Pending'
                       AND d.partition_key IS NOT NULL AND d.visible_at <= @now
                       AND d.cancel_requested_at IS NULL
                       AND NOT EXISTS (
                           SELECT 1 FROM dbo.workqueue_delivery AS f
                            WHERE f.subscription_id = d.subscription_id
                              AND f.partition_key = d.partition_key AND f.status = N'InFlight')
                       AND (@ordered = 0 OR NOT EXISTS (
                           SELECT 1 FROM dbo.workqueue_delivery AS h
                            WHERE h.subscription_id = d.subscription_id
                              AND h.partition_key = d.partition_key
                              AND h.order_key < d.order_key
                              AND h.status IN (N'Pending', N'InFlight', N'DeadLettered')))
                     ORDER BY d.visible_at, d.order_key
                   ) AS c;

            WHILE @remaining > 0
            BEGIN
                SET @candidate = NULL;
                SELECT TOP (1) @ord = c.ord, @candidate = c.id
                  FROM @candidates AS c
                 WHERE c.ord > @ord AND c.first_of_key = 1
                 ORDER BY c.ord;
                IF @candidate IS NULL
                    BREAK;

                DELETE FROM @claimed;
                BEGIN TRY
                    UPDATE d
                       SET status = N'InFlight',
                           lease_owner = @lease_owner,
                           lease_token = LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', '')),
                           lease_expires_at = DATEADD(second, @lease_seconds, @now),
                           last_heartbeat_at = @now,
                           attempt_count = d.attempt_count + 1,
                           progress = NULL
                    OUTPUT inserted.id, inserted.message_id, inserted.lease_token,
                           inserted.lease_expires_at, inserted.attempt_count, inserted.is_replay,
                           inserted.visible_at
                      INTO @claimed
                      FROM dbo.workqueue_delivery AS d
                     WHERE d.id = @candidate AND d.status = N'Pending'
                       AND d.visible_at <= @now AND d.cancel_requested_at IS NULL
                       AND NOT EXISTS (
                           SELECT 1 FROM dbo.workqueue_delivery AS f
                            WHERE f.subscription_id = d.subscription_id
                              AND f.partition_key = d.partition_key AND f.status = N'InFlight')
                       AND (@ordered = 0 OR NOT EXISTS (
                           SELECT 1 FROM dbo.workqueue_delivery AS h
                            WHERE h.subscription_id = d.subscription_id
                              AND h.partition_key = d.partition_key
                              AND h.order_key < d.order_key
                              AND h.status IN (N'Pending', N'InFlight', N'DeadLettered')));
                END TRY
                BEGIN CATCH
                    -- Another consumer put this key in flight first: skip only this candidate.
                    -- Anything else, or a race inside a caller's (now doomed) transaction, is
                    -- raised.
                    IF ERROR_NUMBER() NOT IN (2601, 2627) OR XACT_STATE() = -1
                        THROW;
                    DELETE FROM @claimed;
                END CATCH;

                IF EXISTS (SELECT 1 FROM @claimed)
                BEGIN
                    INSERT INTO @result
                           (phase, sort_at, kind, delivery_id, lease_token, lease_expires_at,
                            attempt_count, is_replay, message_id, topic_id, partition_key,
                            attributes, payload, payload_ref, correlation_id, published_at)
                    SELECT 2, c.visible_at, N'Claimed', dbo.wq_text_uuid(c.id),
                           dbo.wq_text_uuid(c.lease_token), c.lease_expires_at, c.attempt_count,
                           c.is_replay, dbo.wq_text_uuid(m.id), dbo.wq_text_uuid(m.topic_id),
                           m.partition_key, m.attributes, m.payload, m.payload_ref,
                           m.correlation_id, m.published_at
                      FROM @claimed AS c
                      JOIN dbo.workqueue_message AS m ON m.id = c.message_id;
                    SET @remaining -= 1;
                END;
            END;
        END;

        IF @remaining > 0
        BEGIN
            DELETE FROM @claimed;
            WITH picked AS (
                SELECT TOP (@remaining)
                       d.status, d.lease_owner, d.lease_token, d.lease_expires_at,
                       d.last_heartbeat_at, d.attempt_count, d.progress, d.id, d.message_id,
                       d.is_replay, d.visible_at
                  FROM dbo.workqueue_delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                 WHERE d.subscription_id = @subscription_key AND d.status = N'Pending'
                   AND d.partition_key IS NULL AND d.visible_at <= @now
                   AND d.cancel_requested_at IS NULL
                 ORDER BY d.visible_at
            )
            UPDATE picked
               SET status = N'InFlight',
                   lease_owner = @lease_owner,
                   lease_token = LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', '')),
                   lease_expires_at = DATEADD(second, @lease_seconds, @now),
                   last_heartbeat_at = @now,
                   attempt_count = attempt_count + 1,
                   progress = NULL
            OUTPUT inserted.id, inserted.message_id, inserted.lease_token,
                   inserted.lease_expires_at, inserted.attempt_count, inserted.is_replay,
                   inserted.visible_at
              INTO @claimed;

            INSERT INTO @result
                   (phase, sort_at, kind, delivery_id, lease_token, lease_expires_at,
                    attempt_count, is_replay, message_id, topic_id, partition_key, attributes,
                    payload, payload_ref, correlation_id, published_at)
            SELECT 3, c.visible_at, N'Claimed', dbo.wq_text_uuid(c.id),
                   dbo.wq_text_uuid(c.lease_token), c.lease_expires_at, c.attempt_count,
                   c.is_replay, dbo.wq_text_uuid(m.id), dbo.wq_text_uuid(m.topic_id),
                   m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id,
                   m.published_at
              FROM @claimed AS c
              JOIN dbo.workqueue_message AS m ON m.id = c.message_id;
        END;
    END;

    -- result set
    SELECT r.kind, r.delivery_id, r.lease_token, r.lease_expires_at, r.attempt_count,
           r.is_replay, r.message_id, r.topic_id, r.partition_key, r.attributes, r.payload,
           r.payload_ref, r.correlation_id, r.published_at
      FROM @result AS r
     ORDER BY r.phase, CASE WHEN r.phase = 3 THEN r.sort_at END, r.seq;
END;
GO
