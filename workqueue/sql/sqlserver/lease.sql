-- Leases: the holder's heartbeat.

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_extend_lease --
-- Renew a held lease from now, as long as the lease it renews (its expiry less the time it was
-- claimed or last renewed) or the subscription's lease_seconds when that is longer (a lease
-- shortened while the delivery is held would run out between the holder's renewals, which it
-- times by the length its claim gave it), fenced in one UPDATE by (delivery id, lease token,
-- InFlight); the progress is replaced only when one is given. Returns exactly one row:
-- lease_state Held with the new expiry; Cancelled when an operator asked to cancel (the holder
-- should stop and call wq_acknowledge_cancel; the lease is renewed all the same, with its new
-- expiry: a handler that has not stopped yet is still running, and its Exclusive or Ordered key
-- must not be freed for the next delivery beside it); or Lost when the token no longer holds
-- the delivery. A cancel request never changes the token.
-- returns: lease_state, lease_expires_at
CREATE OR ALTER PROCEDURE dbo.wq_extend_lease
    @delivery_id uniqueidentifier,
    @lease_token uniqueidentifier,
    @progress nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @delivery_key char(32) = dbo.wq_uuid_text(@delivery_id);
    DECLARE @token_key char(32) = dbo.wq_uuid_text(@lease_token);
    DECLARE @state nvarchar(20) = N'Lost';
    DECLARE @expires datetimeoffset(7);
    DECLARE @cancelled bit;
    DECLARE @held TABLE (lease_expires_at datetimeoffset(7), cancelled bit);

    UPDATE d
       SET lease_expires_at = DATEADD(
               second,
               CASE WHEN d.last_heartbeat_at IS NOT NULL
                     AND DATEDIFF(second, d.last_heartbeat_at, d.lease_expires_at) > s.lease_seconds
                    THEN DATEDIFF(second, d.last_heartbeat_at, d.lease_expires_at)
                    ELSE s.lease_seconds END,
               @now),
           last_heartbeat_at = @now,
           -- Over 16,000 characters of JSON: a note saying so (review helper-173), as the
           -- PostgreSQL twin stores; the runtime keeps progress within 4,000.
           -- DATALENGTH, not LEN, which leaves out trailing spaces (valid JSON whitespace:
           -- review helper-174); two bytes a character.
           progress = COALESCE(CASE WHEN DATALENGTH(@progress) > 32000
                                    THEN N'{"omitted":"progress over 16000 characters"}'
                                    ELSE @progress END,
                               d.progress)
    OUTPUT inserted.lease_expires_at,
           CASE WHEN inserted.cancel_requested_at IS NULL THEN 0 ELSE 1 END
      INTO @held
      FROM dbo.workqueue_delivery AS d
      JOIN dbo.workqueue_subscription AS s ON s.id = d.subscription_id
     WHERE d.id = @delivery_key AND d.lease_token = @token_key
       -- Or a delivery completed in its handler's transaction whose handler runs on, holding
       -- its key (wq_complete_holding_key) for as long as it is renewed: a live hold only. A
       -- claim of the key takes no row of the hold's, so a hold renewed once it had lapsed
       -- could be the key's second holder (review helper-196).
       AND (d.status = N'InFlight'
            OR (d.status = N'Completed' AND d.lease_expires_at > @now));

    SELECT @expires = h.lease_expires_at, @cancelled = h.cancelled FROM @held AS h;
    IF @expires IS NOT NULL
        SET @state = CASE WHEN @cancelled = 1 THEN N'Cancelled' ELSE N'Held' END;

    -- result set
    SELECT @state AS lease_state, @expires AS lease_expires_at;
END;
GO
