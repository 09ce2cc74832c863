-- Rate limits: one token bucket per rate-limited subscription, shared by every host. A host
-- takes tokens before it claims and claims no more deliveries than it was granted, so the
-- deliveries started per second across all hosts stay within the subscription's
-- rate_limit_per_second (plus its burst after a quiet spell). Over the limit, deliveries wait
-- Pending: nothing is failed or delayed on the row itself.

-- Procedures keep the ANSI_NULLS and QUOTED_IDENTIFIER settings they were created with, and
-- writes to tables with filtered indexes fail unless both are ON, whatever client installs them.
SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- wq_take_rate_tokens --
-- Grant up to @wanted tokens of the subscription's bucket, refilled first at its rate up to its
-- burst (rate_limit_burst, else the rate rounded up, at least 1). An unlimited (or unknown)
-- subscription is granted @wanted at once. wait_ms says how long until a token is next due
-- (0 when something was granted); full_in_ms how long the bucket, as this take leaves it, takes
-- to refill to its burst (what wq_return_rate_tokens weighs tokens given back by; 0 when
-- unlimited). The bucket row is locked for this call only, so hosts take from it one at a time.
-- returns: granted, wait_ms, full_in_ms
CREATE OR ALTER PROCEDURE dbo.wq_take_rate_tokens
    @subscription_id uniqueidentifier,
    @wanted int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @want int = CASE WHEN @wanted IS NULL OR @wanted < 0 THEN 0 ELSE @wanted END;
    DECLARE @rate float;
    DECLARE @burst float;
    DECLARE @available float;
    DECLARE @granted int;

    SELECT @rate = s.rate_limit_per_second,
           @burst = COALESCE(CAST(s.rate_limit_burst AS float),
                             CASE WHEN CEILING(s.rate_limit_per_second) < 1 THEN 1
                                  ELSE CEILING(s.rate_limit_per_second) END)
      FROM dbo.workqueue_subscription AS s
     WHERE s.id = @subscription_key;
    IF @rate IS NULL
        SET @granted = @want;
    ELSE
    BEGIN
        BEGIN TRANSACTION;
        -- A new bucket starts full; the key-range lock makes two first takers agree on one row.
        IF NOT EXISTS (SELECT 1 FROM dbo.workqueue_rate_limit_bucket WITH (UPDLOCK, HOLDLOCK)
                        WHERE subscription_id = @subscription_key)
            INSERT INTO dbo.workqueue_rate_limit_bucket (subscription_id, tokens, refilled_at)
            VALUES (@subscription_key, @burst, @now);
        -- The clock is read only once the row is ours: a time read before waiting for the lock
        -- would be older than the refill the previous taker recorded, and count that time twice.
        SET @now = SYSDATETIMEOFFSET();
        -- Never above the burst, even when the clock stepped back (no refill) and the burst
        -- was lowered since the tokens were counted.
        SELECT @available = CASE WHEN r.tokens > @burst THEN @burst ELSE r.tokens END
          FROM (SELECT b.tokens + CASE WHEN b.refilled_at > @now THEN 0
                                       ELSE @rate * DATEDIFF_BIG(microsecond, b.refilled_at,
                                                                 @now) / 1e6 END AS tokens
                  FROM dbo.workqueue_rate_limit_bucket AS b WITH (UPDLOCK, HOLDLOCK)
                 WHERE b.subscription_id = @subscription_key) AS r;
        SET @granted = CASE WHEN FLOOR(@available) < @want THEN CAST(FLOOR(@available) AS int)
                            ELSE @want END;
        -- Refilled up to now, even when the clock has stepped back past the last refill (that
        -- step added nothing): kept ahead of the clock, the bucket would refill nothing until
        -- the clock caught up.
        UPDATE dbo.workqueue_rate_limit_bucket
           SET tokens = @available - @granted, refilled_at = @now
         WHERE subscription_id = @subscription_key;
        COMMIT TRANSACTION;
    END;

    -- result set
    SELECT @granted AS granted,
           CASE WHEN @rate IS NULL OR @granted > 0 OR @want = 0 THEN 0
                ELSE CAST(CEILING(1000 * (1 - (@available - @granted)) / @rate) AS int)
           END AS wait_ms,
           -- At most a day (an int): wq_return_rate_tokens reads a day as "a day or more".
           CASE WHEN @rate IS NULL OR @burst - (@available - @granted) <= 0 THEN 0
                WHEN 1000 * (@burst - (@available - @granted)) / @rate > 86400000 THEN 86400000
                ELSE CAST(FLOOR(1000 * (@burst - (@available - @granted)) / @rate) AS int)
           END AS full_in_ms;
END;
GO

-- wq_return_rate_tokens --
-- Give back tokens taken but not used (the claim found fewer deliveries than it was granted),
-- never filling the bucket past its burst. Nothing for an unlimited subscription. @held_ms:
-- how long ago the tokens were asked for; @full_in_ms: what the take answered. Only what the
-- bucket would hold had they never been taken comes back: left in it, they would have filled
-- it to its burst (@full_in_ms - @unused / rate) after the take, and what it refilled from
-- then on (which another host may have taken since) is not given again: rate * (@full_in_ms
-- - @held_ms) at most. A caller that does not say (the previous release) gives back all.
-- A take answers a day at most: then the bucket is a day or more from full, so at least the
-- unused tokens less what it refilled since the take (rate * @held_ms) fit, or the day's
-- bound, whichever is more (review helper-185).
-- returns: affected_rows
CREATE OR ALTER PROCEDURE dbo.wq_return_rate_tokens
    @subscription_id uniqueidentifier,
    @unused int,
    @held_ms int = NULL,
    @full_in_ms int = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @given float = CASE WHEN @unused IS NULL OR @unused < 0 THEN 0 ELSE @unused END;
    DECLARE @changed TABLE (id char(32));

    UPDATE b
       SET tokens = CASE WHEN r.tokens > r.burst THEN r.burst ELSE r.tokens END
    OUTPUT inserted.subscription_id INTO @changed
      FROM dbo.workqueue_rate_limit_bucket AS b
      JOIN dbo.workqueue_subscription AS s ON s.id = b.subscription_id
     CROSS APPLY (
        SELECT CASE WHEN @held_ms IS NULL OR @full_in_ms IS NULL THEN @given
                    -- A day or more from full: the unused less the refill since the take, or
                    -- the day's bound, whichever is more (at most @given, below).
                    WHEN @full_in_ms >= 86400000
                        THEN CASE WHEN @given - s.rate_limit_per_second * @held_ms / 1000.0
                                       > s.rate_limit_per_second * (86400000 - @held_ms) / 1000.0
                                  THEN @given - s.rate_limit_per_second * @held_ms / 1000.0
                                  ELSE s.rate_limit_per_second * (86400000 - @held_ms) / 1000.0
                             END
                    ELSE s.rate_limit_per_second * (@full_in_ms - @held_ms) / 1000.0
               END AS may_return
     ) AS m
     CROSS APPLY (
        SELECT b.tokens + CASE WHEN m.may_return <= 0 THEN 0
                               WHEN m.may_return < @given THEN m.may_return
                               ELSE @given END AS tokens,
               COALESCE(CAST(s.rate_limit_burst AS float),
                        CASE WHEN CEILING(s.rate_limit_per_second) < 1 THEN 1
                             ELSE CEILING(s.rate_limit_per_second) END) AS burst
     ) AS r
     WHERE b.subscription_id = @subscription_key AND s.rate_limit_per_second IS NOT NULL
       AND @given > 0;

    -- result set
    SELECT COUNT(*) AS affected_rows FROM @changed;
END;
GO
