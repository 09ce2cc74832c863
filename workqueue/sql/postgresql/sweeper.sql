-- Sweeper: lease expiry across all subscriptions and retention purges, in bounded batches.
-- Each batch is clamped to 1..5000 (NULL: 1000), as the bulk operator procedures' are: any
-- role granted the sweeper's steps passes its own batch size, and LIMIT NULL is no limit
-- (review helper-173).
-- One pass at a time cluster-wide: the sweeper holds wq_try_sweep_lock's row lock, for its
-- transaction, on a private connection while it runs the steps on another.
-- Each step reads by index with sequential scans left aside: the sweeper keeps its connection
-- (and a PL/pgSQL step its plans) for the host's life, and a plan made while the tables were
-- nearly empty must not read them end to end once they have filled.
-- JIT is left aside too. A scan of the topics (there is no other way to read each topic's
-- retention) is a sequential scan, so with them disabled every plan's estimate carries
-- disable_cost and passes every JIT threshold: each call compiled its plan with inlining and
-- optimisation first, some 150-300 ms of CPU for a batch that deletes in a few milliseconds.

-- wq_expire_leases_all --
-- wq_settle_expired_leases for up to p_batch_size passed leases across every subscription
-- (each with its own max_attempts), oldest first, skipping rows locked by a concurrent settle.
-- Also clears up to as many passed key holds (wq_complete_holding_key) that nobody let go of (a
-- host that died, a release that failed): the key has been free since, and the completed row
-- would go on naming a lease holder.
CREATE OR REPLACE FUNCTION wq_expire_leases_all(p_batch_size integer)
RETURNS TABLE (delivery_id uuid, subscription_id uuid, partition_key text, new_status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
BEGIN
    UPDATE workqueue_delivery d
       SET lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = ANY (ARRAY(
        SELECT k.id
          FROM workqueue_delivery k
         WHERE k.status = 'Completed' AND k.lease_expires_at < now()
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
           FOR UPDATE SKIP LOCKED))
       AND d.status = 'Completed' AND d.lease_expires_at < now();
    RETURN QUERY
    SELECT * FROM wq_settle_expired_leases(ARRAY(
        SELECT d.id
          FROM workqueue_delivery d
         WHERE d.status = 'InFlight' AND d.lease_expires_at < now()
         ORDER BY d.lease_expires_at
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
           FOR UPDATE SKIP LOCKED));
END;
$$;

-- wq_purge_terminal_deliveries --
-- Delete up to p_batch_size Completed/Discarded deliveries older than their topic's retention.
-- Dead letters are never purged: they wait for an operator; nor is a completed delivery whose
-- handler still holds its partition key (wq_complete_holding_key).
-- Subscription by subscription, each along wq_dlv_settled_ix up to its own topic's cutoff: until
-- 0048 every subscription's were read in one order of age, so each batch read all the settled
-- deliveries that topics with a longer retention than the shortest still keep.
CREATE OR REPLACE FUNCTION wq_purge_terminal_deliveries(p_batch_size integer)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
    -- The victims as an array the DELETE probes by primary key: joined as a relation, the
    -- planner (which cannot tell how many a batch size leaves) could hash the whole table.
    WITH deleted AS (
        DELETE FROM workqueue_delivery d
         WHERE d.id = ANY (ARRAY(
            SELECT v.id
              FROM workqueue_subscription s
              JOIN workqueue_topic t ON t.id = s.topic_id
             CROSS JOIN LATERAL (
                SELECT x.id
                  FROM workqueue_delivery x
                 WHERE x.subscription_id = s.id
                   AND x.status IN ('Completed', 'Discarded')
                   AND x.completed_at < now() - make_interval(days => t.retention_days)
                   -- A hold still live: its handler runs on (review helper-199).
                   AND NOT (x.status = 'Completed' AND x.lease_expires_at IS NOT NULL
                            AND x.lease_expires_at > now())
                 ORDER BY x.completed_at
                 LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
                   FOR UPDATE OF x SKIP LOCKED
             ) v
             LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)))
        RETURNING 1
    )
    SELECT count(*)::integer FROM deleted;
$$;

-- wq_purge_orphan_messages --
-- Delete up to p_batch_size messages older than their topic's retention that no delivery refers
-- to any more (every delivery was purged, or the publish matched no subscription).
CREATE OR REPLACE FUNCTION wq_purge_orphan_messages(p_batch_size integer)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
    -- Topic by topic, each along wq_msg_purge_ix up to its own cutoff: joined the other way,
    -- the plan read every message of every topic (the youngest included) on every pass.
    WITH victims AS (
        SELECT v.id
          FROM workqueue_topic t
         CROSS JOIN LATERAL (
            SELECT m.id
              FROM workqueue_message m
             WHERE m.topic_id = t.id
               AND m.published_at < now() - make_interval(days => t.retention_days)
               AND NOT EXISTS (SELECT 1 FROM workqueue_delivery d WHERE d.message_id = m.id)
             LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
               FOR UPDATE OF m SKIP LOCKED
         ) v
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
    ), deleted AS (
        DELETE FROM workqueue_message m USING victims v WHERE m.id = v.id RETURNING 1
    )
    SELECT count(*)::integer FROM deleted;
$$;

-- wq_purge_expired_deduplications --
-- Delete up to p_batch_size ledger rows whose window has passed.
CREATE OR REPLACE FUNCTION wq_purge_expired_deduplications(p_batch_size integer)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
    WITH victims AS (
        SELECT x.id FROM workqueue_deduplication x
         WHERE x.expires_at <= now()
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
           FOR UPDATE SKIP LOCKED
    ), deleted AS (
        DELETE FROM workqueue_deduplication x USING victims v WHERE x.id = v.id RETURNING 1
    )
    SELECT count(*)::integer FROM deleted;
$$;

-- wq_try_sweep_lock --
-- Try (without waiting) to take the cluster-wide sweep lock for the current transaction: the one
-- row of workqueue_sweep_lock, locked. acquired = false means another sweeper is mid-pass; skip
-- this one. A row lock, not an advisory lock (until 0044): any role that may connect can take an
-- advisory lock, and a session that is no sweeper holding it stopped every pass; only the owner
-- may lock this row. The transaction then sits idle while the pass runs on another connection,
-- its sweeper touching it every SWEEP_LOCK_KEEPALIVE_SECONDS (30): a server's
-- idle_in_transaction_session_timeout shorter than that would end the session, free the lock
-- mid-pass for a second sweeper, and fail the first pass at its end, so the timeout is ten
-- minutes for this transaction, and PostgreSQL 17's transaction_timeout is off for it. Until
-- 0040 the server's timeout applied; until 0048 there was none, so a sweeper frozen mid-pass
-- (SIGSTOP, a paused VM: the kernel still answers TCP keepalives) held the lock, and stopped
-- every instance's passes, for as long as it stayed frozen.
CREATE OR REPLACE FUNCTION wq_try_sweep_lock()
RETURNS TABLE (acquired boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Only putting a missing row back can wait (on another sweeper putting it back): not for long.
SET lock_timeout = '50ms'
AS $$
DECLARE
    v_acquired boolean;
BEGIN
    PERFORM set_config('idle_in_transaction_session_timeout', '10min', true);
    IF current_setting('server_version_num')::integer >= 170000 THEN
        PERFORM set_config('transaction_timeout', '0', true);
    END IF;
    PERFORM 1 FROM workqueue_sweep_lock WHERE id = 1 FOR UPDATE SKIP LOCKED;
    v_acquired := FOUND;
    IF NOT v_acquired THEN
        -- Held by another sweeper, or gone (a `flush` empties every table): put it back, and
        -- then it is this transaction's. A sweeper putting it back right now keeps it.
        BEGIN
            INSERT INTO workqueue_sweep_lock (id) VALUES (1) ON CONFLICT DO NOTHING;
            v_acquired := FOUND;
        EXCEPTION WHEN lock_not_available THEN
            v_acquired := false;
        END;
    END IF;
    RETURN QUERY SELECT v_acquired;
END;
$$;
