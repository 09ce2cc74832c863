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
    -- Clamped as the operators' batches are: any role granted this step passes its own size
    -- (review helper-173).
    SET @batch_size = CASE WHEN @batch_size IS NULL THEN 500
                           WHEN @batch_size > 5000 THEN 5000
                           WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;
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

-- wq_next_open_key --
-- The first partition key after @after_key (the very first when it is NULL) among the
-- subscription's open deliveries: one step of a loose scan of wq_dlv_partition_head_ix, shared
-- by the key walks of wq_claim, wq_backlog and wq_list_partitions. @subscription_id is the
-- stored char(32) form.
CREATE OR ALTER FUNCTION dbo.wq_next_open_key(
    @subscription_id char(32),
    @after_key nvarchar(200)
)
RETURNS nvarchar(200)
AS
BEGIN
    DECLARE @next_key nvarchar(200);
    IF @after_key IS NULL
        SELECT TOP (1) @next_key = k.partition_key
          FROM dbo.workqueue_delivery AS k
         WHERE k.subscription_id = @subscription_id AND k.partition_key IS NOT NULL
           AND k.status IN (N'Pending', N'InFlight', N'DeadLettered')
         ORDER BY k.partition_key;
    ELSE
        SELECT TOP (1) @next_key = k.partition_key
          FROM dbo.workqueue_delivery AS k
         WHERE k.subscription_id = @subscription_id AND k.partition_key IS NOT NULL
           AND k.status IN (N'Pending', N'InFlight', N'DeadLettered')
           AND k.partition_key > @after_key
         ORDER BY k.partition_key;
    RETURN @next_key;
END;
GO

-- wq_next_priority --
-- The highest priority below @below among the subscription's Pending deliveries, keyed (@keyed)
-- or keyless, or NULL: one backward seek of wq_dlv_claim_keyed_pri_ix or
-- wq_dlv_claim_keyless_pri_ix. wq_claim visits the priorities present this way, each a range of
-- rows already due, so rows scheduled for later are never read. Pass 101 for the highest of
-- all. @subscription_id is the stored char(32) form.
CREATE OR ALTER FUNCTION dbo.wq_next_priority(
    @subscription_id char(32),
    @keyed bit,
    @below int
)
RETURNS int
AS
BEGIN
    DECLARE @level int;
    IF @keyed = 1
        SELECT TOP (1) @level = k.priority
          FROM dbo.workqueue_delivery AS k
         WHERE k.subscription_id = @subscription_id AND k.status = N'Pending'
           AND k.partition_key IS NOT NULL AND k.priority < @below
         ORDER BY k.priority DESC;
    ELSE
        SELECT TOP (1) @level = k.priority
          FROM dbo.workqueue_delivery AS k
         WHERE k.subscription_id = @subscription_id AND k.status = N'Pending'
           AND k.partition_key IS NULL AND k.priority < @below
         ORDER BY k.priority DESC;
    RETURN @level;
END;
GO

-- wq_claim --
-- Lease up to @max_rows deliveries of an Active subscription to @lease_owner in one call,
-- @max_rows clamped to 0..5000 (NULL: 0), the claim cap a host also holds its ask to
-- (workqueue.conf.MAX_CLAIM_ROWS), as the PostgreSQL twin clamps p_max_rows: any role granted
-- the claim passes its own count (review helper-176).
-- First expires this subscription's passed leases (up to 500); rows of kind 'ExpiredDeadLetter'
-- report the ones that were dead-lettered. Partitioned subscriptions then claim at most one
-- delivery per key: the key's first due Pending row by order_key when nothing of the key is in
-- flight (Ordered: when that row is the key's head, so no earlier Pending, InFlight or
-- DeadLettered delivery exists; a head not yet due holds its key). Priority orders keys and
-- keyless rows, never the rows within one key. Keys come from a window of visible keyed rows,
-- highest priority and then oldest due first; when that window is full of rows whose keys
-- cannot run and capacity is left, a bounded walk over the keys continues after @after_key, so
-- a hot key's blocked backlog never makes claims slower. A row of kind 'KeyCursor' carries where
-- the walk stopped, for the caller's next claim. Each key's claim is a guarded UPDATE that
-- re-checks every rule; a unique-index violation (2601/2627) means another consumer won that
-- key, and only that key is skipped. Keyless deliveries are claimed in skip-locked batches
-- (UPDLOCK, READPAST, ROWLOCK), taking their turn among the keys by priority and then by due
-- time, so keyless work of a higher priority never waits behind keyed work (nor older keyless
-- work behind newer keys). Each claim sets a fresh lease token (made from @claim_id, the
-- caller's new id for each call, and the row's id; at random without @claim_id: one of its own
-- for every row either way), lease_expires_at = now + lease_seconds, last_heartbeat_at = now,
-- attempt_count + 1 and clears progress. Rows of kind 'Claimed' come in claim order.
-- @retake_claim_id names an earlier call of this @lease_owner that may have committed while its
-- answer was lost with the connection. The deliveries it took that are still held on its tokens
-- (no cancel asked) come first, whatever the subscription's status (they were claimed while it
-- ran): their attempt unchanged, their leases renewed from now and their tokens made anew from
-- @claim_id, so a later call naming that claim again never hands them out twice. They count
-- against @max_rows; a row of kind 'Retaken' says how many there were (in its attempt_count
-- column), so the caller names that claim again while they filled the call.
-- Call it outside a transaction: inside one, a lost key race dooms the caller's transaction and
-- is raised instead of skipped. It runs wq_expire_leases through INSERT ... EXEC, so it cannot
-- itself be the target of an INSERT ... EXEC.
-- When anything was claimed, a last row of kind 'Lease' says how long the leases are, in its
-- attempt_count column: the subscription's setting now, which the caller's copy of it may not be
-- yet; a delivery keeps that length while it is held (wq_extend_lease). A row of a new kind, not
-- a new column: the previous release reads this result by position, and passes over kinds it
-- does not know.
-- returns: kind, delivery_id, lease_token, lease_expires_at, attempt_count, is_replay, message_id, topic_id, partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE dbo.wq_claim
    @subscription_id uniqueidentifier,
    @lease_owner nvarchar(4000),
    @max_rows int,
    @after_key nvarchar(4000),
    @claim_id uniqueidentifier = NULL,
    @retake_claim_id uniqueidentifier = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET @max_rows = CASE WHEN @max_rows IS NULL OR @max_rows < 0 THEN 0
                         WHEN @max_rows > 5000 THEN 5000 ELSE @max_rows END;
    SET XACT_ABORT ON;
    DECLARE @now datetimeoffset(7) = SYSDATETIMEOFFSET();
    DECLARE @subscription_key char(32) = dbo.wq_uuid_text(@subscription_id);
    DECLARE @claim char(32) = dbo.wq_uuid_text(@claim_id);
    DECLARE @retake_claim char(32) = dbo.wq_uuid_text(@retake_claim_id);
    DECLARE @partition_mode nvarchar(20);
    DECLARE @lease_seconds int;
    DECLARE @subscription_status nvarchar(20);
    DECLARE @ordered bit;
    DECLARE @remaining int = @max_rows;
    DECLARE @candidate char(32);
    DECLARE @window_size int = @max_rows * 4 + 32;
    DECLARE @window_full bit = 0;
    DECLARE @window_taken int = 0;
    DECLARE @window_count int;
    DECLARE @level int;
    DECLARE @next int = 0;
    DECLARE @walking bit = 0;
    DECLARE @walk_budget int = @max_rows * 4 + 64;
    DECLARE @walked_from_start bit = 0;
    DECLARE @walked_key bit = 0;
    DECLARE @candidate_priority int;
    DECLARE @candidate_since datetimeoffset(7);
    DECLARE @walk_at nvarchar(200);
    DECLARE @walked_to nvarchar(200);
    DECLARE @keys_done bit = 0;
    DECLARE @key nvarchar(200);
    DECLARE @key_level int;
    DECLARE @key_since datetimeoffset(7);
    DECLARE @key_tried nvarchar(200);
    DECLARE @keyless_level int;
    DECLARE @keyless_below int = 101;
    DECLARE @keyless_known bit = 0;
    DECLARE @keyless_tried_for_key bit = 0;
    DECLARE @due_before datetimeoffset(7);
    -- Later than any due time: "no bound" for a batch of keyless rows.
    DECLARE @never datetimeoffset(7) = '9999-12-31T23:59:59.9999999+00:00';
    DECLARE @head_id char(32);
    DECLARE @head_status nvarchar(20);
    DECLARE @head_visible_at datetimeoffset(7);
    DECLARE @head_cancel_requested_at datetimeoffset(7);
    DECLARE @window_keys TABLE (
        ord int PRIMARY KEY,
        partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2,
        priority int,
        first_visible datetimeoffset(7),
        rows_in_window int
    );
    DECLARE @seen TABLE (partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2);
    DECLARE @expired TABLE (
        delivery_id uniqueidentifier,
        subscription_id uniqueidentifier,
        partition_key nvarchar(200) COLLATE Latin1_General_100_BIN2,
        new_status nvarchar(20)
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
    BEGIN
        INSERT INTO @expired (delivery_id, subscription_id, partition_key, new_status)
        EXEC dbo.wq_expire_leases @subscription_id = @subscription_id, @batch_size = 500;
        -- wq_expire_leases read the clock again and made what it handed back visible from
        -- then: read on, so that this claim can take it (as on PostgreSQL, where one
        -- transaction has one now()) instead of leaving it to a later claim.
        SET @now = SYSDATETIMEOFFSET();
    END;

    INSERT INTO @result (phase, kind, delivery_id, partition_key)
    SELECT 1, N'ExpiredDeadLetter', e.delivery_id, e.partition_key
      FROM @expired AS e
     WHERE e.new_status = N'DeadLettered';

    -- A Disabled topic or transport stops its subscriptions' claims as a Paused subscription
    -- does, at once (until 0044 hosts stopped claiming only at their next re-plan).
    SELECT @partition_mode = s.partition_mode,
           @lease_seconds = s.lease_seconds,
           @subscription_status = CASE WHEN t.status = N'Active' AND tr.status = N'Active'
                                       THEN s.status ELSE N'Paused' END
      FROM dbo.workqueue_subscription AS s
      JOIN dbo.workqueue_topic AS t ON t.id = s.topic_id
      JOIN dbo.workqueue_transport AS tr ON tr.id = t.transport_id
     WHERE s.id = @subscription_key;
    SET @ordered = CASE WHEN @partition_mode = N'Ordered' THEN 1 ELSE 0 END;

    -- (A claim naming itself would hand back, under the same tokens, what it just took.)
    IF @retake_claim IS NOT NULL AND @retake_claim <> ISNULL(@claim, '') AND @max_rows >= 1
    BEGIN
        -- The subscription's InFlight rows (wq_dlv_open_ix), on a call after one that raised
        -- only. Rows another session holds locked are skipped, as every claim skips them, and
        -- left to their lease.
        WITH held AS (
            SELECT TOP (@remaining)
                   d.lease_expires_at, d.last_heartbeat_at, d.lease_token, d.id, d.message_id,
                   d.attempt_count, d.is_replay, d.visible_at
              FROM dbo.workqueue_delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
             WHERE d.subscription_id = @subscription_key AND d.status = N'InFlight'
               AND d.lease_owner = @lease_owner
               AND d.lease_token = LOWER(LEFT(CONVERT(char(64),
                       HASHBYTES('SHA2_256', @retake_claim + d.id), 2), 32))
               AND d.lease_expires_at > @now AND d.cancel_requested_at IS NULL
             ORDER BY d.visible_at
        )
        UPDATE held
           SET lease_expires_at = DATEADD(second, @lease_seconds, @now),
               last_heartbeat_at = @now,
               lease_token = CASE WHEN @claim IS NULL
                                  THEN LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', ''))
                                  ELSE LOWER(LEFT(CONVERT(char(64),
                                       HASHBYTES('SHA2_256', @claim + id), 2), 32)) END
        OUTPUT inserted.id, inserted.message_id, inserted.lease_token,
               inserted.lease_expires_at, inserted.attempt_count, inserted.is_replay,
               inserted.visible_at
          INTO @claimed;
        SET @remaining -= @@ROWCOUNT;

        INSERT INTO @result
               (phase, kind, delivery_id, lease_token, lease_expires_at, attempt_count,
                is_replay, message_id, topic_id, partition_key, attributes, payload,
                payload_ref, correlation_id, published_at)
        SELECT 2, N'Claimed', dbo.wq_text_uuid(c.id), dbo.wq_text_uuid(c.lease_token),
               c.lease_expires_at, c.attempt_count, c.is_replay,
               dbo.wq_text_uuid(m.id), dbo.wq_text_uuid(m.topic_id), m.partition_key,
               m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
          FROM @claimed AS c
          JOIN dbo.workqueue_message AS m ON m.id = c.message_id
         ORDER BY c.visible_at;
        INSERT INTO @result (phase, kind, attempt_count)
        VALUES (3, N'Retaken', @max_rows - @remaining);
    END;

    -- Nothing is claimed either when what was handed back filled the call.
    IF @subscription_status = N'Active' AND @remaining >= 1
    BEGIN
        IF @partition_mode <> N'None'
        BEGIN
            -- The window: keys of visible keyed Pending rows, priority by priority (highest
            -- first), oldest due first within one, each with its priority and its oldest due
            -- time there. It reads a fixed number of wq_dlv_claim_keyed_pri_ix entries,
            -- whatever the backlog, due or scheduled. A key met again at a lower priority is
            -- skipped by the key loop (@seen).
            SET @level = 101;
            WHILE @window_taken < @window_size
            BEGIN
                SET @level = dbo.wq_next_priority(@subscription_key, 1, @level);
                IF @level IS NULL
                    BREAK;
                SET @window_count = (SELECT COUNT(*) FROM @window_keys);
                INSERT INTO @window_keys (ord, partition_key, priority, first_visible,
                                          rows_in_window)
                SELECT @window_count
                       + ROW_NUMBER() OVER (ORDER BY MIN(r.visible_at), MIN(r.order_key)),
                       r.partition_key, @level, MIN(r.visible_at), COUNT(*)
                  FROM (
                        SELECT TOP (@window_size - @window_taken)
                               d.partition_key, d.visible_at, d.order_key
                          FROM dbo.workqueue_delivery AS d
                         WHERE d.subscription_id = @subscription_key AND d.status = N'Pending'
                           AND d.partition_key IS NOT NULL AND d.priority = @level
                           AND d.visible_at <= @now
                         ORDER BY d.visible_at
                       ) AS r
                 GROUP BY r.partition_key;
                SET @window_taken =
                    COALESCE((SELECT SUM(w.rows_in_window) FROM @window_keys AS w), 0);
            END;
            IF @window_taken >= @window_size
                SET @window_full = 1;
        END
        ELSE
            SET @keys_done = 1;

        -- Keys and keyless deliveries in one order: higher priority first and, within one,
        -- oldest due first (a key by its window priority and oldest due row there; a key the
        -- walk finds, by the row it would run). Each turn claims either the next key or a
        -- skip-locked batch of keyless rows ahead of it.
        WHILE @remaining > 0
        BEGIN
            -- The next key to try, unless one already waits its turn: from the window, then
            -- (if it was full) from the walk; only a key with a candidate (read through
            -- wq_dlv_partition_head_ix) waits its turn. A window key ranks by its window
            -- priority and oldest due row; a key the walk finds, by its candidate's.
            WHILE @key IS NULL AND @keys_done = 0
            BEGIN
                SET @walked_key = 0;
                IF @walking = 0
                BEGIN
                    SET @next += 1;
                    SELECT @key = w.partition_key, @key_level = w.priority,
                           @key_since = w.first_visible
                      FROM @window_keys AS w WHERE w.ord = @next;
                    IF @key IS NULL
                    BEGIN
                        IF @window_full = 1
                        BEGIN
                            SET @walking = 1;
                            SET @walk_at = @after_key;
                        END
                        ELSE
                            SET @keys_done = 1;
                    END;
                END;
                IF @walking = 1
                BEGIN
                    IF @walk_budget <= 0
                    BEGIN
                        SET @keys_done = 1;
                        BREAK;
                    END;
                    SET @walk_budget -= 1;
                    -- The next key with open deliveries, wrapping around to the first once.
                    SET @key = dbo.wq_next_open_key(@subscription_key, @walk_at);
                    SET @walk_at = @key;
                    IF @key IS NULL
                    BEGIN
                        SET @keys_done = @walked_from_start;
                        SET @walked_from_start = 1;
                        CONTINUE;
                    END;
                    SET @walked_key = 1;
                END;
                IF @key IS NULL
                    CONTINUE;
                SET @candidate = NULL;
                IF NOT EXISTS (SELECT 1 FROM @seen AS s WHERE s.partition_key = @key)
                BEGIN
                    INSERT INTO @seen (partition_key) VALUES (@key);
                    IF @ordered = 1
                    BEGIN
                        SET @head_id = NULL;
                        SELECT TOP (1) @head_id = h.id, @head_status = h.status,
                               @head_visible_at = h.visible_at,
                               @head_cancel_requested_at = h.cancel_requested_at,
                               @candidate_priority = h.priority
                          FROM dbo.workqueue_delivery AS h
                         WHERE h.subscription_id = @subscription_key AND h.partition_key = @key
                           AND h.status IN (N'Pending', N'InFlight', N'DeadLettered')
                         ORDER BY h.order_key;
                        IF @head_id IS NOT NULL AND @head_status = N'Pending'
                           AND @head_visible_at <= @now
                           AND @head_cancel_requested_at IS NULL
                           AND NOT EXISTS (
                               SELECT 1 FROM dbo.workqueue_delivery AS k
                                WHERE k.subscription_id = @subscription_key
                                  AND k.partition_key = @key AND k.status = N'Completed'
                                  AND k.lease_expires_at > @now)
                        BEGIN
                            SET @candidate = @head_id;
                            SET @candidate_since = @head_visible_at;
                        END;
                    END
                    ELSE IF NOT EXISTS (
                        SELECT 1 FROM dbo.workqueue_delivery AS f
                         WHERE f.subscription_id = @subscription_key AND f.partition_key = @key
                           AND f.status = N'InFlight')
                      AND NOT EXISTS (
                        SELECT 1 FROM dbo.workqueue_delivery AS k
                         WHERE k.subscription_id = @subscription_key AND k.partition_key = @key
                           AND k.status = N'Completed' AND k.lease_expires_at > @now)
                        SELECT TOP (1) @candidate = c.id, @candidate_priority = c.priority,
                               @candidate_since = c.visible_at
                          FROM dbo.workqueue_delivery AS c
                         WHERE c.subscription_id = @subscription_key AND c.partition_key = @key
                           AND c.status = N'Pending' AND c.visible_at <= @now
                           AND c.cancel_requested_at IS NULL
                         ORDER BY c.order_key;
                END;
                IF @candidate IS NULL
                BEGIN
                    -- Seen already, or nothing of it can run now: the walk goes on past it.
                    IF @walked_key = 1
                        SET @walked_to = @key;
                    SET @key = NULL;
                END
                ELSE IF @walked_key = 1
                BEGIN
                    SET @key_level = @candidate_priority;
                    SET @key_since = @candidate_since;
                END;
            END;

            -- Keyless rows go first when they are of a higher priority than the waiting key
            -- or, of the same one, due before it.
            IF @keyless_known = 0
            BEGIN
                SET @keyless_level = dbo.wq_next_priority(@subscription_key, 0, @keyless_below);
                SET @keyless_known = 1;
            END;
            IF @keyless_level IS NOT NULL AND (
                   @key IS NULL OR @keyless_level > @key_level
                   OR (@keyless_level = @key_level AND @keyless_tried_for_key = 0))
            BEGIN
                SET @due_before = CASE WHEN @key IS NOT NULL AND @keyless_level = @key_level
                                       THEN @key_since ELSE @never END;
                DELETE FROM @claimed;
                WITH picked AS (
                    SELECT TOP (@remaining)
                           d.status, d.lease_owner, d.lease_token, d.lease_expires_at,
                           d.last_heartbeat_at, d.attempt_count, d.progress, d.id, d.message_id,
                           d.is_replay, d.visible_at
                      FROM dbo.workqueue_delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                     WHERE d.subscription_id = @subscription_key AND d.status = N'Pending'
                       AND d.partition_key IS NULL AND d.priority = @keyless_level
                       AND d.visible_at <= @now AND d.visible_at < @due_before
                       AND d.cancel_requested_at IS NULL
                     ORDER BY d.visible_at
                )
                UPDATE picked
                   SET status = N'InFlight',
                       lease_owner = @lease_owner,
                       lease_token = CASE WHEN @claim IS NULL
                                          THEN LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', ''))
                                          ELSE LOWER(LEFT(CONVERT(char(64),
                                               HASHBYTES('SHA2_256', @claim + id), 2), 32)) END,
                       lease_expires_at = DATEADD(second, @lease_seconds, @now),
                       last_heartbeat_at = @now,
                       attempt_count = attempt_count + 1,
                       progress = NULL
                OUTPUT inserted.id, inserted.message_id, inserted.lease_token,
                       inserted.lease_expires_at, inserted.attempt_count, inserted.is_replay,
                       inserted.visible_at
                  INTO @claimed;
                SET @remaining -= @@ROWCOUNT;

                -- Oldest due first: the identity follows this ORDER BY.
                INSERT INTO @result
                       (phase, kind, delivery_id, lease_token, lease_expires_at, attempt_count,
                        is_replay, message_id, topic_id, partition_key, attributes, payload,
                        payload_ref, correlation_id, published_at)
                SELECT 2, N'Claimed', dbo.wq_text_uuid(c.id), dbo.wq_text_uuid(c.lease_token),
                       c.lease_expires_at, c.attempt_count, c.is_replay,
                       dbo.wq_text_uuid(m.id), dbo.wq_text_uuid(m.topic_id), m.partition_key,
                       m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
                  FROM @claimed AS c
                  JOIN dbo.workqueue_message AS m ON m.id = c.message_id
                 ORDER BY c.visible_at;

                IF @remaining > 0
                BEGIN
                    -- Nothing more of this priority is claimable now (or nothing due before
                    -- the waiting key): on to the next priority, or to the key.
                    IF @due_before = @never
                    BEGIN
                        SET @keyless_below = @keyless_level;
                        SET @keyless_known = 0;
                    END
                    ELSE
                        SET @keyless_tried_for_key = 1;
                END;
                CONTINUE;
            END;
            IF @key IS NULL
                BREAK;

            -- The key's turn. Whatever comes of it, the next turn takes the next key; a key
            -- the walk found is where the walk has got to only now.
            SET @key_tried = @key;
            SET @key = NULL;
            SET @keyless_tried_for_key = 0;
            IF @walked_key = 1
                SET @walked_to = @key_tried;

            DELETE FROM @claimed;
            BEGIN TRY
                UPDATE d
                   SET status = N'InFlight',
                       lease_owner = @lease_owner,
                       lease_token = CASE WHEN @claim IS NULL
                                          THEN LOWER(REPLACE(CONVERT(char(36), NEWID()), '-', ''))
                                          ELSE LOWER(LEFT(CONVERT(char(64),
                                               HASHBYTES('SHA2_256', @claim + d.id), 2), 32)) END,
                       lease_expires_at = DATEADD(second, @lease_seconds, @now),
                       last_heartbeat_at = @now,
                       attempt_count = d.attempt_count + 1,
                       progress = NULL
                OUTPUT inserted.id, inserted.message_id, inserted.lease_token,
                       inserted.lease_expires_at, inserted.attempt_count, inserted.is_replay,
                       inserted.visible_at
                  INTO @claimed
                  -- A candidate row another session holds locked is skipped this time, not
                  -- waited for (as the keyless claim and PostgreSQL's SKIP LOCKED do).
                  FROM dbo.workqueue_delivery AS d WITH (READPAST, ROWLOCK)
                 WHERE d.id = @candidate AND d.status = N'Pending'
                   AND d.visible_at <= @now AND d.cancel_requested_at IS NULL
                   AND NOT EXISTS (
                       SELECT 1 FROM dbo.workqueue_delivery AS f
                        WHERE f.subscription_id = d.subscription_id
                          AND f.partition_key = d.partition_key AND f.status = N'InFlight')
                   -- Nor while a completed delivery of the key holds it: its handler, which
                   -- completed in its own transaction, still runs (wq_complete_holding_key).
                   AND NOT EXISTS (
                       SELECT 1 FROM dbo.workqueue_delivery AS k
                        WHERE k.subscription_id = d.subscription_id
                          AND k.partition_key = d.partition_key AND k.status = N'Completed'
                          AND k.lease_expires_at > @now)
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
                       (phase, kind, delivery_id, lease_token, lease_expires_at, attempt_count,
                        is_replay, message_id, topic_id, partition_key, attributes, payload,
                        payload_ref, correlation_id, published_at)
                SELECT 2, N'Claimed', dbo.wq_text_uuid(c.id), dbo.wq_text_uuid(c.lease_token),
                       c.lease_expires_at, c.attempt_count, c.is_replay,
                       dbo.wq_text_uuid(m.id), dbo.wq_text_uuid(m.topic_id), m.partition_key,
                       m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
                  FROM @claimed AS c
                  JOIN dbo.workqueue_message AS m ON m.id = c.message_id;
                SET @remaining -= 1;
            END;
        END;

        -- A key the walk found that still waits as the claim fills up is passed over when
        -- keyless work of a higher priority kept it waiting (the keys after it, which may rank
        -- higher, must not wait behind it claim after claim), and kept for the next claim when
        -- only older keyless work of its own priority did (its turn is near).
        IF @key IS NOT NULL AND @walked_key = 1 AND @keyless_level > @key_level
            SET @walked_to = @key;
        IF @walked_to IS NOT NULL
            INSERT INTO @result (phase, kind, partition_key) VALUES (3, N'KeyCursor', @walked_to);
    END;

    IF EXISTS (SELECT 1 FROM @result AS r WHERE r.kind = N'Claimed')
        INSERT INTO @result (phase, kind, attempt_count) VALUES (4, N'Lease', @lease_seconds);

    -- result set
    SELECT r.kind, r.delivery_id, r.lease_token, r.lease_expires_at, r.attempt_count,
           r.is_replay, r.message_id, r.topic_id, r.partition_key, r.attributes, r.payload,
           r.payload_ref, r.correlation_id, r.published_at
      FROM @result AS r
     ORDER BY r.phase, r.seq;
END;
GO
