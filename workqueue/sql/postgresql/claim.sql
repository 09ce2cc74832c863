-- Claiming: lease expiry for one subscription and the batch claim that hands deliveries to a
-- consumer. Every claim is a guarded UPDATE; the partial unique index on (subscription,
-- partition_key) WHERE InFlight is the final word on single flight per key.

-- wq_settle_expired_leases --
-- Settle the given InFlight deliveries whose lease has passed (callers select and lock them):
-- a cancelled one becomes Discarded, one with attempts left becomes Pending again (visible now,
-- no backoff), one on its last attempt becomes DeadLettered with reason LeaseExpired. The
-- status and expiry are re-checked, so a row settled meanwhile is left alone. Returns every row
-- it changed with its new status.
CREATE OR REPLACE FUNCTION wq_settle_expired_leases(p_delivery_ids uuid[])
RETURNS TABLE (delivery_id uuid, subscription_id uuid, partition_key text, new_status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH decided AS (
        SELECT d.id,
               CASE WHEN d.cancel_requested_at IS NOT NULL THEN 'Discarded'
                    WHEN d.attempt_count < s.max_attempts THEN 'Pending'
                    ELSE 'DeadLettered' END AS next_status
          FROM workqueue_delivery d
          JOIN workqueue_subscription s ON s.id = d.subscription_id
         WHERE d.id = ANY (p_delivery_ids)
    )
    UPDATE workqueue_delivery d
       SET status = x.next_status,
           visible_at = CASE WHEN x.next_status = 'Pending' THEN now() ELSE d.visible_at END,
           completed_at = CASE WHEN x.next_status = 'Discarded' THEN now() ELSE d.completed_at END,
           last_error = CASE WHEN x.next_status = 'Discarded' THEN d.last_error
                             ELSE 'LeaseExpired' END,
           dead_letter_reason = CASE WHEN x.next_status = 'DeadLettered' THEN 'LeaseExpired'
                                     ELSE d.dead_letter_reason END,
           dead_lettered_at = CASE WHEN x.next_status = 'DeadLettered' THEN now()
                                   ELSE d.dead_lettered_at END,
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
      FROM decided x
     WHERE d.id = x.id AND d.status = 'InFlight' AND d.lease_expires_at < now()
    RETURNING d.id, d.subscription_id, d.partition_key::text, d.status::text;
END;
$$;

-- wq_expire_leases --
-- wq_settle_expired_leases for up to p_batch_size passed leases of one subscription (oldest
-- first; rows locked by a concurrent settle are skipped, not waited for).
CREATE OR REPLACE FUNCTION wq_expire_leases(p_subscription_id uuid, p_batch_size integer)
RETURNS TABLE (delivery_id uuid, subscription_id uuid, partition_key text, new_status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    SELECT * FROM wq_settle_expired_leases(ARRAY(
        SELECT d.id
          FROM workqueue_delivery d
         WHERE d.status = 'InFlight' AND d.lease_expires_at < now()
           AND d.subscription_id = p_subscription_id
         ORDER BY d.lease_expires_at
         LIMIT p_batch_size
           FOR UPDATE SKIP LOCKED));
END;
$$;

-- wq_claim --
-- Lease up to p_max_rows deliveries of an Active subscription to p_lease_owner in one call.
-- First expires this subscription's passed leases (rows of kind 'ExpiredDeadLetter' report the
-- ones that were dead-lettered). Partitioned subscriptions then claim at most one delivery per
-- key, each with its own guarded statement that re-checks every rule (Exclusive: nothing of the
-- key in flight; Ordered: also no earlier Pending/InFlight/DeadLettered delivery of the key); a
-- unique violation means another consumer won that key and only that candidate is skipped.
-- Remaining capacity goes to keyless deliveries, claimed in one skip-locked batch.
-- Each claim sets a fresh lease token, the lease expiry and attempt_count + 1.
CREATE OR REPLACE FUNCTION wq_claim(
    p_subscription_id uuid,
    p_lease_owner text,
    p_max_rows integer
)
RETURNS TABLE (
    kind text,
    delivery_id uuid,
    lease_token uuid,
    lease_expires_at timestamptz,
    attempt_count integer,
    is_replay boolean,
    message_id uuid,
    topic_id uuid,
    partition_key text,
    attributes jsonb,
    payload jsonb,
    payload_ref jsonb,
    correlation_id text,
    published_at timestamptz
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_sub record;
    v_remaining integer := p_max_rows;
    v_seen text[] := '{}';
    v_candidate record;
    v_lease interval;
BEGIN
    -- A cheap probe of the lease index first: most claims find no passed lease, and then the
    -- expiry statement (row locks, a write) is skipped.
    IF EXISTS (
        SELECT 1 FROM workqueue_delivery x
         WHERE x.status = 'InFlight' AND x.lease_expires_at < now()
           AND x.subscription_id = p_subscription_id
    ) THEN
        RETURN QUERY
        SELECT 'ExpiredDeadLetter'::text, e.delivery_id, NULL::uuid, NULL::timestamptz,
               NULL::integer, NULL::boolean, NULL::uuid, NULL::uuid, e.partition_key,
               NULL::jsonb, NULL::jsonb, NULL::jsonb, NULL::text, NULL::timestamptz
          FROM wq_expire_leases(p_subscription_id, 500) e
         WHERE e.new_status = 'DeadLettered';
    END IF;

    SELECT s.partition_mode, s.lease_seconds, s.status INTO v_sub
      FROM workqueue_subscription s WHERE s.id = p_subscription_id;
    IF NOT FOUND OR v_sub.status <> 'Active' OR p_max_rows < 1 THEN
        RETURN;
    END IF;
    v_lease := make_interval(secs => v_sub.lease_seconds);

    IF v_sub.partition_mode <> 'None' THEN
        FOR v_candidate IN
            SELECT d.id, d.partition_key
              FROM workqueue_delivery d
             WHERE d.subscription_id = p_subscription_id AND d.status = 'Pending'
               AND d.partition_key IS NOT NULL AND d.visible_at <= now()
               AND d.cancel_requested_at IS NULL
               AND NOT EXISTS (
                   SELECT 1 FROM workqueue_delivery f
                    WHERE f.subscription_id = d.subscription_id
                      AND f.partition_key = d.partition_key AND f.status = 'InFlight')
               AND (v_sub.partition_mode <> 'Ordered' OR NOT EXISTS (
                   SELECT 1 FROM workqueue_delivery h
                    WHERE h.subscription_id = d.subscription_id
                      AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                      AND h.status IN ('Pending', 'InFlight', 'DeadLettered')))
             -- Index order of wq_dlv_claim_ix, so the scan stops after the first candidates
             -- instead of sorting the backlog. Ties need no order: Ordered candidates are heads.
             ORDER BY d.visible_at
             LIMIT p_max_rows * 4
        LOOP
            EXIT WHEN v_remaining <= 0;
            CONTINUE WHEN v_candidate.partition_key = ANY (v_seen);
            v_seen := v_seen || v_candidate.partition_key;
            -- Never wait on another claimer: waiting while holding this call's earlier claims
            -- can deadlock two claimers that meet keys in different orders. A key another
            -- claimer is working on, or a row someone else has locked, is skipped this time.
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended(
                'wq-claim:' || lower(p_subscription_id::text) || ':' || v_candidate.partition_key,
                0));
            PERFORM 1 FROM workqueue_delivery r WHERE r.id = v_candidate.id FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            BEGIN
                RETURN QUERY
                WITH claimed AS (
                    UPDATE workqueue_delivery d
                       SET status = 'InFlight', lease_owner = p_lease_owner,
                           lease_token = gen_random_uuid(), lease_expires_at = now() + v_lease,
                           last_heartbeat_at = now(), attempt_count = d.attempt_count + 1,
                           progress = NULL
                     WHERE d.id = v_candidate.id AND d.status = 'Pending'
                       AND d.visible_at <= now() AND d.cancel_requested_at IS NULL
                       AND NOT EXISTS (
                           SELECT 1 FROM workqueue_delivery f
                            WHERE f.subscription_id = d.subscription_id
                              AND f.partition_key = d.partition_key AND f.status = 'InFlight')
                       AND (v_sub.partition_mode <> 'Ordered' OR NOT EXISTS (
                           SELECT 1 FROM workqueue_delivery h
                            WHERE h.subscription_id = d.subscription_id
                              AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                              AND h.status IN ('Pending', 'InFlight', 'DeadLettered')))
                    RETURNING d.id, d.message_id, d.lease_token, d.lease_expires_at,
                              d.attempt_count, d.is_replay
                )
                SELECT 'Claimed'::text, c.id, c.lease_token, c.lease_expires_at, c.attempt_count,
                       c.is_replay, m.id, m.topic_id, m.partition_key::text, m.attributes, m.payload,
                       m.payload_ref, m.correlation_id::text, m.published_at
                  FROM claimed c JOIN workqueue_message m ON m.id = c.message_id;
                IF FOUND THEN
                    v_remaining := v_remaining - 1;
                END IF;
            EXCEPTION WHEN unique_violation THEN
                -- Another consumer put this key in flight first; skip only this candidate.
                NULL;
            END;
        END LOOP;
    END IF;

    IF v_remaining > 0 THEN
        RETURN QUERY
        WITH picked AS (
            SELECT d.id
              FROM workqueue_delivery d
             WHERE d.subscription_id = p_subscription_id AND d.status = 'Pending'
               AND d.partition_key IS NULL AND d.visible_at <= now()
               AND d.cancel_requested_at IS NULL
             ORDER BY d.visible_at
             LIMIT v_remaining
               FOR UPDATE SKIP LOCKED
        ), claimed AS (
            UPDATE workqueue_delivery d
               SET status = 'InFlight', lease_owner = p_lease_owner,
                   lease_token = gen_random_uuid(), lease_expires_at = now() + v_lease,
                   last_heartbeat_at = now(), attempt_count = d.attempt_count + 1,
                   progress = NULL
              FROM picked
             WHERE d.id = picked.id
            RETURNING d.id, d.message_id, d.lease_token, d.lease_expires_at, d.attempt_count,
                      d.is_replay, d.visible_at
        )
        SELECT 'Claimed'::text, c.id, c.lease_token, c.lease_expires_at, c.attempt_count,
               c.is_replay, m.id, m.topic_id, m.partition_key::text, m.attributes, m.payload,
               m.payload_ref, m.correlation_id::text, m.published_at
          FROM claimed c JOIN workqueue_message m ON m.id = c.message_id
         ORDER BY c.visible_at;
    END IF;
END;
$$;
