-- Settling: the holder's final word on a delivery. Each procedure is ONE UPDATE fenced by
-- (delivery id, lease token, InFlight, no cancel request); affected_rows = 1 means it took
-- effect, 0 means the caller no longer holds the lease (LeaseLost). Every settle clears the
-- lease columns. The changed ids are captured with OUTPUT and counted, so the count cannot be
-- disturbed by later statements the way @@ROWCOUNT can.

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_complete --
-- InFlight -> Completed, completed now.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_complete
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Completed', completed_at = @now,
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'InFlight'
       AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_complete_holding_key --
-- InFlight -> Completed, as wq_complete, from inside a handler's own transaction, whose
-- handler runs on after the commit: a keyed delivery keeps its lease columns, which hold its
-- partition key (wq_claim starts none of the key's deliveries while a Completed row of it holds
-- an unexpired lease, which its holder goes on renewing) until the handler returns
-- (wq_release_key) or the lease ends (a host that died). Completed at the commit all the same:
-- the work never runs again (review helper-193).
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_complete_holding_key
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    -- The hold starts with a whole lease from the call (a block may have outlasted the lease
    -- it had): the holder renews it (wq_extend_lease) until its handler returns.
    UPDATE d
       SET status = N'Completed', completed_at = @now,
           lease_owner = CASE WHEN d.partition_key IS NULL THEN NULL ELSE d.lease_owner END,
           lease_token = CASE WHEN d.partition_key IS NULL THEN NULL ELSE d.lease_token END,
           lease_expires_at = CASE
               WHEN d.partition_key IS NULL THEN NULL
               WHEN d.lease_expires_at > DATEADD(second, s.lease_seconds, @now)
                   THEN d.lease_expires_at
               ELSE DATEADD(second, s.lease_seconds, @now) END,
           last_heartbeat_at = CASE WHEN d.partition_key IS NULL THEN d.last_heartbeat_at
                                    ELSE @now END
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
      JOIN dbo.workqueue_subscription AS s ON s.id = d.subscription_id
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'InFlight'
       AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_release_key --
-- The handler of a delivery completed by wq_complete_holding_key has returned: its partition
-- key is free again. Fenced by the lease token; 0 rows when the lease had ended already.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_release_key
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'Completed';

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_complete_many --
-- Complete a JSON array of {"delivery_id", "lease_token"} objects in one UPDATE, each fenced
-- exactly as wq_complete. Returns the ids that were completed; an id that is missing lost its
-- lease.
-- returns: delivery_id
CREATE OR ALTER PROCEDURE dbo.wq_complete_many
    @items nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @pairs TABLE (delivery_key char(32), token_key char(32));
    DECLARE @changed TABLE (id char(32));

    INSERT INTO @pairs (delivery_key, token_key)
    SELECT dbo.wq_uuid_text(i.delivery_id), dbo.wq_uuid_text(i.lease_token)
      FROM OPENJSON(@items)
           WITH (delivery_id uniqueidentifier '$.delivery_id',
                 lease_token uniqueidentifier '$.lease_token') AS i;

    UPDATE d
       SET status = N'Completed', completed_at = @now,
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
      JOIN @pairs AS p ON p.delivery_key = d.id AND p.token_key = d.lease_token
     WHERE d.status = N'InFlight' AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT dbo.wq_text_uuid(c.id) AS delivery_id FROM @changed AS c;
END;
GO

-- wq_retry --
-- InFlight -> Pending, visible again after @delay_seconds (negative or NULL means now); the
-- attempt stays counted and the error text (cut to 16,000 characters) replaces last_error.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_retry
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier,
    @delay_seconds int,
    @error nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Pending',
           visible_at = DATEADD(second, CASE WHEN @delay_seconds > 0 THEN @delay_seconds ELSE 0 END, @now),
           last_error = LEFT(@error, 16000),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'InFlight'
       AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_dead_letter --
-- InFlight -> DeadLettered with a short reason (cut to 100 characters), dead-lettered now; the
-- error text (cut to 16,000 characters) replaces last_error only when given. A dead letter waits for an operator to replay
-- or discard it.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_dead_letter
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier,
    @reason nvarchar(4000),
    @error nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'DeadLettered', dead_letter_reason = LEFT(@reason, 100),
           dead_lettered_at = @now, last_error = COALESCE(LEFT(@error, 16000), d.last_error),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'InFlight'
       AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_release --
-- InFlight -> Pending, visible now, with the attempt refunded (never below 0): used when a host
-- shuts down before the handler finished.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_release
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Pending', visible_at = @now,
           attempt_count = CASE WHEN d.attempt_count > 0 THEN d.attempt_count - 1 ELSE 0 END,
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'InFlight'
       AND d.cancel_requested_at IS NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO

-- wq_acknowledge_cancel --
-- The holder confirms it stopped a cancelled delivery: InFlight with a cancel request ->
-- Discarded, completed now, which frees an Exclusive/Ordered key at once. The only settle that
-- requires the cancel flag; the lease token still fences it.
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_acknowledge_cancel
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @changed TABLE (id char(32));

    UPDATE d
       SET status = N'Discarded', completed_at = @now,
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
    OUTPUT inserted.id INTO @changed
      FROM dbo.workqueue_delivery AS d
     WHERE d.id = @delivery_key AND d.lease_token = @token_key AND d.status = N'InFlight'
       AND d.cancel_requested_at IS NOT NULL;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO
