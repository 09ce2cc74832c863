-- Claiming: lease expiry for one subscription and the batch claim that hands deliveries to a
-- consumer. Every claim is a guarded UPDATE; the partial unique index on (subscription,
-- partition_key) WHERE InFlight is the final word on single flight per key.
-- Every function here reads with sequential scans left aside (the two walk helpers through their
-- callers' setting, see wq_next_open_key): a plan kept for the session may have been made while
-- the table was nearly empty, and must still read by index once a burst has filled it.

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
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
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
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
BEGIN
    RETURN QUERY
    SELECT * FROM wq_settle_expired_leases(ARRAY(
        SELECT d.id
          FROM workqueue_delivery d
         WHERE d.status = 'InFlight' AND d.lease_expires_at < now()
           AND d.subscription_id = p_subscription_id
         ORDER BY d.lease_expires_at
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 500), 1), 5000)
           FOR UPDATE SKIP LOCKED));
END;
$$;

-- wq_next_open_key --
-- The first partition key after p_after_key (the very first when it is NULL) among the
-- subscription's open deliveries: one step of a loose scan of wq_dlv_partition_head_ix, shared
-- by the key walks of wq_claim, wq_backlog and wq_list_partitions. Two statements, each ORDER BY ... LIMIT 1 rather than
-- min(), so that each stays one index probe even when stale statistics make the subscription
-- look tiny. Only the procedures call it (EXECUTE is revoked from PUBLIC), inside their pinned
-- search_path, so it needs neither SECURITY DEFINER nor a search_path of its own (whose
-- save and restore would cost every step of a walk). Nor does it set enable_seqscan: its plans,
-- kept for the session, are made under the settings of whichever caller runs it first, so every
-- caller (wq_claim, wq_backlog, wq_list_partitions, wq_queue_gauges) leaves sequential scans
-- aside itself; tests/integration/test_query_plans.py checks each after a burst.
CREATE OR REPLACE FUNCTION wq_next_open_key(p_subscription_id uuid, p_after_key text)
RETURNS text
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    IF p_after_key IS NULL THEN
        RETURN (SELECT k.partition_key FROM workqueue_delivery k
                 WHERE k.subscription_id = p_subscription_id AND k.partition_key IS NOT NULL
                   AND k.status IN ('Pending', 'InFlight', 'DeadLettered')
                 ORDER BY k.partition_key LIMIT 1);
    END IF;
    RETURN (SELECT k.partition_key FROM workqueue_delivery k
             WHERE k.subscription_id = p_subscription_id AND k.partition_key IS NOT NULL
               AND k.status IN ('Pending', 'InFlight', 'DeadLettered')
               AND k.partition_key > p_after_key
             ORDER BY k.partition_key LIMIT 1);
END;
$$;

-- wq_next_priority --
-- The highest priority below p_below among the subscription's Pending deliveries, keyed
-- (p_keyed) or keyless, or NULL: one backward probe of wq_dlv_claim_keyed_pri_ix or
-- wq_dlv_claim_keyless_pri_ix. wq_claim visits the priorities present this way (with the same
-- probes written out in its body), each as a range of rows already due, so rows scheduled for
-- later are never read, however many there are. Pass 101 for the highest of all. Called only
-- by the procedures, like wq_next_open_key.
CREATE OR REPLACE FUNCTION wq_next_priority(
    p_subscription_id uuid, p_keyed boolean, p_below integer
)
RETURNS integer
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    IF p_keyed THEN
        RETURN (SELECT k.priority FROM workqueue_delivery k
                 WHERE k.subscription_id = p_subscription_id AND k.status = 'Pending'
                   AND k.partition_key IS NOT NULL AND k.priority < p_below
                 ORDER BY k.priority DESC LIMIT 1);
    END IF;
    RETURN (SELECT k.priority FROM workqueue_delivery k
             WHERE k.subscription_id = p_subscription_id AND k.status = 'Pending'
               AND k.partition_key IS NULL AND k.priority < p_below
             ORDER BY k.priority DESC LIMIT 1);
END;
$$;

-- wq_claim --
-- Lease up to p_max_rows deliveries of an Active subscription to p_lease_owner in one call,
-- p_max_rows clamped to 0..5000 (NULL: 0, as on SQL Server), the claim cap a host also holds
-- its ask to (workqueue.conf.MAX_CLAIM_ROWS): any role granted the claim passes its own count,
-- and one call leased 100,000 deliveries in one transaction, or, given NULL, spun for ever
-- (review helper-176).
-- First expires this subscription's passed leases (rows of kind 'ExpiredDeadLetter' report the
-- ones that were dead-lettered). Partitioned subscriptions then claim at most one delivery per
-- key: the key's first due Pending row by order_key, when nothing of the key is in flight
-- (Ordered: when that row is the key's head, so no earlier Pending/InFlight/DeadLettered delivery
-- exists; a head not yet due holds its key). Priority orders keys and keyless rows, never the
-- rows within one key: publish order decides there.
-- Keys come from a window of visible keyed rows, highest priority and then oldest due first;
-- when that window is full of rows whose keys cannot run (a hot key's backlog behind its
-- in-flight or dead-lettered head) and capacity is left, a bounded walk over the keys continues
-- after p_after_key, so the cost of a claim never follows a blocked backlog. A row of kind
-- 'KeyCursor' carries where the walk stopped, for the caller's next claim. Each key's claim is a
-- guarded statement that re-checks every rule; a unique violation means another consumer won
-- that key and only that key is skipped. Keyless deliveries are claimed in skip-locked batches,
-- taking their turn among the keys by priority and then by due time, so keyless work of a
-- higher priority never waits behind keyed work (nor older keyless work behind newer keys).
-- Each claim sets a fresh lease token, the lease expiry and attempt_count + 1. The token is made
-- from p_claim_id (the caller's new id for each call) and the row's id, or at random when
-- p_claim_id is NULL: one of its own for every row either way.
-- p_retake_claim_id names an earlier call of this p_lease_owner that may have committed while
-- its answer was lost with the connection. The deliveries it took that are still held on its
-- tokens (no cancel asked) come first, whatever the subscription's status (they were claimed
-- while it ran): their attempt unchanged, their leases renewed from now (the caller times its
-- renewals from this call) and their tokens made anew from p_claim_id, so a later call naming
-- that claim again never hands them out twice. They count against p_max_rows; a row of kind
-- 'Retaken' says how many there were (in its attempt_count column), so the caller names that
-- claim again while they filled the call. Without this they would wait out their lease and run
-- as a further attempt (dead-lettered unrun on a last one). When anything was
-- claimed, a last row of kind 'Lease' says how long the leases are, in its attempt_count column
-- (as a 'KeyCursor' row carries its key in partition_key): the subscription's setting now, which
-- the caller's copy of it may not be yet; a delivery keeps that length while it is held
-- (wq_extend_lease). A row of a new kind, not a new column: the previous release reads the
-- result by position on SQL Server, and passes over kinds it does not know.
-- Its statements keep one plan per session (plan_cache_mode below): a LIMIT taken from a
-- variable made PostgreSQL re-plan the batch claim on every call, which cost about a third of
-- a claim. Such a generic plan is costed for a tenth of the backlog, and with one subscription
-- owning the table that made a sequential scan and a sort look cheaper than the claim index;
-- every statement here is written for an index (tests/integration/test_query_plans.py), so the
-- planner is told to leave sequential scans aside unless no index fits. (And not to compile:
-- JIT never pays off for a claim.)
CREATE OR REPLACE FUNCTION wq_claim(
    p_subscription_id uuid,
    p_lease_owner text,
    p_max_rows integer,
    p_after_key text,
    p_claim_id uuid DEFAULT NULL,
    p_retake_claim_id uuid DEFAULT NULL
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
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_sub record;
    v_ordered boolean;
    v_max_rows integer := LEAST(GREATEST(coalesce(p_max_rows, 0), 0), 5000);
    v_remaining integer := v_max_rows;
    v_window_size integer := v_max_rows * 4 + 32;
    v_window_keys text[] := '{}';
    v_window_levels integer[] := '{}';
    v_window_since timestamptz[] := '{}';
    v_window_taken integer := 0;
    v_window_full boolean;
    v_level integer;
    v_level_keys text[];
    v_level_since timestamptz[];
    v_level_rows integer;
    v_count integer;
    v_next integer := 0;
    v_walking boolean := false;
    v_walk_budget integer := v_max_rows * 4 + 64;
    v_walked_from_start boolean := false;
    v_walk_at text;
    v_walked_key boolean := false;
    v_walked_to text;
    v_keys_done boolean := false;
    v_key text;
    v_key_level integer;
    v_key_since timestamptz;
    v_key_tried text;
    v_keyless_level integer;
    v_keyless_below integer := 101;
    v_keyless_known boolean := false;
    v_keyless_tried_for_key boolean := false;
    v_due_before timestamptz;
    v_seen text[] := '{}';
    v_candidate_id uuid;
    v_candidate_priority integer;
    v_candidate_since timestamptz;
    v_candidate_row tid;
    v_head record;
    v_lease interval;
    v_picked tid[];
BEGIN
    -- The subscription, and a cheap probe of the lease index in the same statement: most
    -- claims find no passed lease, and then the expiry statement (row locks, a write) is
    -- skipped. Passed leases expire whatever the subscription's status. A Disabled topic or
    -- transport stops its subscriptions' claims as a Paused subscription does, at once (until
    -- 0044 hosts stopped claiming only at their next re-plan, up to RECONCILE_INTERVAL_MS).
    SELECT s.partition_mode, s.lease_seconds,
           CASE WHEN t.status = 'Active' AND tr.status = 'Active' THEN s.status
                ELSE 'Paused' END AS status,
           EXISTS (SELECT 1 FROM workqueue_delivery x
                    WHERE x.status = 'InFlight' AND x.lease_expires_at < now()
                      AND x.subscription_id = p_subscription_id) AS leases_passed
      INTO v_sub
      FROM workqueue_subscription s
      JOIN workqueue_topic t ON t.id = s.topic_id
      JOIN workqueue_transport tr ON tr.id = t.transport_id
     WHERE s.id = p_subscription_id;
    IF v_sub.leases_passed THEN
        RETURN QUERY
        SELECT 'ExpiredDeadLetter'::text, e.delivery_id, NULL::uuid, NULL::timestamptz,
               NULL::integer, NULL::boolean, NULL::uuid, NULL::uuid, e.partition_key,
               NULL::jsonb, NULL::jsonb, NULL::jsonb, NULL::text, NULL::timestamptz
          FROM wq_expire_leases(p_subscription_id, 500) e
         WHERE e.new_status = 'DeadLettered';
    END IF;
    v_lease := make_interval(secs => v_sub.lease_seconds);

    -- (A claim naming itself would hand back, under the same tokens, what it just took.)
    IF p_retake_claim_id IS NOT NULL AND p_retake_claim_id IS DISTINCT FROM p_claim_id
       AND v_max_rows >= 1 THEN
        RETURN QUERY
        WITH retaken AS (
            -- The subscription's InFlight rows, read through wq_dlv_open_ix: as many as it has
            -- in flight, on a call after one that raised only. Rows another session holds
            -- locked are skipped, as every claim skips them, and left to their lease.
            UPDATE workqueue_delivery d
               SET lease_expires_at = now() + v_lease, last_heartbeat_at = now(),
                   lease_token = CASE WHEN p_claim_id IS NULL THEN gen_random_uuid()
                       ELSE substr(encode(sha256(convert_to(
                                p_claim_id::text || d.id::text, 'UTF8')), 'hex'), 1, 32)::uuid
                       END
             WHERE d.id IN (
                   SELECT h.id FROM workqueue_delivery h
                    WHERE h.subscription_id = p_subscription_id AND h.status = 'InFlight'
                      AND h.lease_owner = p_lease_owner
                      AND h.lease_token = substr(encode(sha256(convert_to(
                              p_retake_claim_id::text || h.id::text, 'UTF8')), 'hex'), 1, 32)::uuid
                      AND h.lease_expires_at > now() AND h.cancel_requested_at IS NULL
                    ORDER BY h.visible_at
                    LIMIT v_max_rows
                      FOR UPDATE SKIP LOCKED)
            RETURNING d.id, d.message_id, d.lease_token, d.lease_expires_at,
                      d.attempt_count::integer, d.is_replay, d.visible_at
        )
        SELECT 'Claimed'::text, c.id, c.lease_token, c.lease_expires_at, c.attempt_count,
               c.is_replay, m.id, m.topic_id, m.partition_key::text, m.attributes, m.payload,
               m.payload_ref, m.correlation_id::text, m.published_at
          FROM retaken c
         CROSS JOIN LATERAL (
               SELECT x.id, x.topic_id, x.partition_key, x.attributes, x.payload,
                      x.payload_ref, x.correlation_id, x.published_at
                 FROM workqueue_message x WHERE x.id = c.message_id OFFSET 0) m
         ORDER BY c.visible_at;
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_remaining := v_remaining - v_count;
        RETURN QUERY
        SELECT 'Retaken'::text, NULL::uuid, NULL::uuid, NULL::timestamptz, v_count,
               NULL::boolean, NULL::uuid, NULL::uuid, NULL::text, NULL::jsonb, NULL::jsonb,
               NULL::jsonb, NULL::text, NULL::timestamptz;
    END IF;
    -- (status is never NULL: NULL here means no such subscription.) Nothing is claimed either
    -- when what was handed back filled the call.
    IF v_sub.status IS DISTINCT FROM 'Active' OR v_remaining < 1 THEN
        IF v_remaining < v_max_rows THEN
            RETURN QUERY
            SELECT 'Lease'::text, NULL::uuid, NULL::uuid, NULL::timestamptz, v_sub.lease_seconds,
                   NULL::boolean, NULL::uuid, NULL::uuid, NULL::text, NULL::jsonb, NULL::jsonb,
                   NULL::jsonb, NULL::text, NULL::timestamptz;
        END IF;
        RETURN;
    END IF;
    v_ordered := v_sub.partition_mode = 'Ordered';

    IF v_sub.partition_mode <> 'None' THEN
        -- The window: keys of visible keyed Pending rows, priority by priority (highest
        -- first), oldest due first within one, each with its priority and its oldest due time
        -- there. It reads a fixed number of wq_dlv_claim_keyed_pri_ix entries, whatever the
        -- backlog, due or scheduled.
        v_level := 101;
        LOOP
            EXIT WHEN v_window_taken >= v_window_size;
            -- wq_next_priority's keyed probe, written out: a nested PL/pgSQL call adds its
            -- own set-up to every level a claim visits.
            v_level := (SELECT k.priority FROM workqueue_delivery k
                         WHERE k.subscription_id = p_subscription_id AND k.status = 'Pending'
                           AND k.partition_key IS NOT NULL AND k.priority < v_level
                         ORDER BY k.priority DESC LIMIT 1);
            EXIT WHEN v_level IS NULL;
            SELECT coalesce(array_agg(w.partition_key ORDER BY w.first_visible, w.first_order),
                            '{}'),
                   coalesce(array_agg(w.first_visible ORDER BY w.first_visible, w.first_order),
                            '{}'),
                   coalesce(sum(w.n), 0)
              INTO v_level_keys, v_level_since, v_level_rows
              FROM (
                    SELECT r.partition_key, min(r.visible_at) AS first_visible,
                           min(r.order_key) AS first_order, count(*) AS n
                      FROM (
                            SELECT d.partition_key, d.visible_at, d.order_key
                              FROM workqueue_delivery d
                             WHERE d.subscription_id = p_subscription_id
                               AND d.status = 'Pending' AND d.partition_key IS NOT NULL
                               AND d.priority = v_level AND d.visible_at <= now()
                             ORDER BY d.visible_at
                             LIMIT v_window_size - v_window_taken
                           ) r
                     GROUP BY r.partition_key
                   ) w;
            -- A key met again at a lower priority is skipped by the key loop (v_seen).
            v_window_keys := v_window_keys || v_level_keys;
            v_window_since := v_window_since || v_level_since;
            v_window_levels := v_window_levels
                               || array_fill(v_level, ARRAY[cardinality(v_level_keys)]);
            v_window_taken := v_window_taken + v_level_rows;
        END LOOP;
        v_window_full := v_window_taken >= v_window_size;
    ELSE
        v_keys_done := true;
    END IF;

    -- Keys and keyless deliveries in one order: higher priority first and, within one, oldest
    -- due first (a key by its window priority and oldest due row there; a key the walk finds,
    -- by the row it would run). Each turn claims either the next key or a skip-locked batch of
    -- keyless rows ahead of it.
    LOOP
        EXIT WHEN v_remaining <= 0;
        -- The next key to try, unless one already waits its turn: from the window, then (if
        -- it was full) from the walk; only a key with a candidate (read through
        -- wq_dlv_partition_head_ix) waits its turn. A window key ranks by its window priority
        -- and oldest due row; a key the walk finds, by its candidate's.
        WHILE v_key IS NULL AND NOT v_keys_done LOOP
            v_walked_key := false;
            IF NOT v_walking THEN
                v_next := v_next + 1;
                IF v_next <= coalesce(cardinality(v_window_keys), 0) THEN
                    v_key := v_window_keys[v_next];
                    v_key_level := v_window_levels[v_next];
                    v_key_since := v_window_since[v_next];
                ELSIF v_window_full THEN
                    v_walking := true;
                    v_walk_at := p_after_key;
                ELSE
                    v_keys_done := true;
                END IF;
            END IF;
            IF v_walking THEN
                IF v_walk_budget <= 0 THEN
                    v_keys_done := true;
                    EXIT;
                END IF;
                v_walk_budget := v_walk_budget - 1;
                -- The next key with open deliveries, wrapping around to the first key once.
                v_key := wq_next_open_key(p_subscription_id, v_walk_at);
                v_walk_at := v_key;
                IF v_key IS NULL THEN
                    v_keys_done := v_walked_from_start;
                    v_walked_from_start := true;
                    CONTINUE;
                END IF;
                v_walked_key := true;
            END IF;
            CONTINUE WHEN v_key IS NULL;
            v_candidate_id := NULL;
            IF NOT v_key = ANY (v_seen) THEN
                v_seen := v_seen || v_key;
                IF v_ordered THEN
                    SELECT h.id, h.status, h.visible_at, h.cancel_requested_at, h.priority
                      INTO v_head
                      FROM workqueue_delivery h
                     WHERE h.subscription_id = p_subscription_id AND h.partition_key = v_key
                       AND h.status IN ('Pending', 'InFlight', 'DeadLettered')
                     ORDER BY h.order_key
                     LIMIT 1;
                    IF FOUND AND v_head.status = 'Pending' AND v_head.visible_at <= now()
                       AND v_head.cancel_requested_at IS NULL
                       AND NOT EXISTS (
                           SELECT 1 FROM workqueue_delivery k
                            WHERE k.subscription_id = p_subscription_id
                              AND k.partition_key = v_key AND k.status = 'Completed'
                              AND k.lease_expires_at > now()) THEN
                        v_candidate_id := v_head.id;
                        v_candidate_priority := v_head.priority;
                        v_candidate_since := v_head.visible_at;
                    END IF;
                ELSIF NOT EXISTS (
                    SELECT 1 FROM workqueue_delivery f
                     WHERE f.subscription_id = p_subscription_id AND f.partition_key = v_key
                       AND f.status = 'InFlight')
                  AND NOT EXISTS (
                    SELECT 1 FROM workqueue_delivery k
                     WHERE k.subscription_id = p_subscription_id AND k.partition_key = v_key
                       AND k.status = 'Completed' AND k.lease_expires_at > now()) THEN
                    -- The key's open rows in order_key order, first runnable one wins. Asking
                    -- for every open status (and fencing the Pending test off with OFFSET 0)
                    -- leaves wq_dlv_partition_head_ix as the only index that fits: with stale
                    -- statistics the planner would otherwise pick wq_dlv_claim_keyed_pri_ix
                    -- and read every Pending row.
                    SELECT o.id, o.priority, o.visible_at
                      INTO v_candidate_id, v_candidate_priority, v_candidate_since
                      FROM (SELECT c.id, c.status, c.visible_at, c.cancel_requested_at,
                                   c.priority
                              FROM workqueue_delivery c
                             WHERE c.subscription_id = p_subscription_id
                               AND c.partition_key = v_key
                               AND c.status IN ('Pending', 'InFlight', 'DeadLettered')
                             ORDER BY c.order_key
                            OFFSET 0) o
                     WHERE o.status = 'Pending' AND o.visible_at <= now()
                       AND o.cancel_requested_at IS NULL
                     LIMIT 1;
                END IF;
            END IF;
            IF v_candidate_id IS NULL THEN
                -- Seen already, or nothing of it can run now: the walk goes on past it.
                IF v_walked_key THEN
                    v_walked_to := v_key;
                END IF;
                v_key := NULL;
            ELSIF v_walked_key THEN
                v_key_level := v_candidate_priority;
                v_key_since := v_candidate_since;
            END IF;
        END LOOP;

        -- Keyless rows go first when they are of a higher priority than the waiting key or,
        -- of the same one, due before it. wq_next_priority's keyless probe, written out.
        IF NOT v_keyless_known THEN
            v_keyless_level := (SELECT k.priority FROM workqueue_delivery k
                                 WHERE k.subscription_id = p_subscription_id
                                   AND k.status = 'Pending' AND k.partition_key IS NULL
                                   AND k.priority < v_keyless_below
                                 ORDER BY k.priority DESC LIMIT 1);
            v_keyless_known := true;
        END IF;
        IF v_keyless_level IS NOT NULL AND (
               v_key IS NULL OR v_keyless_level > v_key_level
               OR (v_keyless_level = v_key_level AND NOT v_keyless_tried_for_key)) THEN
            v_due_before := CASE WHEN v_key IS NOT NULL AND v_keyless_level = v_key_level
                                 THEN v_key_since ELSE 'infinity' END;
            v_picked := ARRAY(
                SELECT p.ctid
                  FROM workqueue_delivery p
                 WHERE p.subscription_id = p_subscription_id AND p.status = 'Pending'
                   AND p.partition_key IS NULL AND p.priority = v_keyless_level
                   AND p.visible_at <= now() AND p.visible_at < v_due_before
                   AND p.cancel_requested_at IS NULL
                 ORDER BY p.visible_at
                 LIMIT v_remaining
                   FOR UPDATE SKIP LOCKED);
            IF cardinality(v_picked) > 0 THEN
                RETURN QUERY
                WITH claimed AS (
                    -- The picked rows by ctid (locked, so they cannot move): a TID probe per
                    -- row.
                    UPDATE workqueue_delivery d
                       SET status = 'InFlight', lease_owner = p_lease_owner,
                           lease_token = CASE WHEN p_claim_id IS NULL THEN gen_random_uuid()
                               ELSE substr(encode(sha256(convert_to(
                                        p_claim_id::text || d.id::text, 'UTF8')), 'hex'),
                                           1, 32)::uuid END,
                           lease_expires_at = now() + v_lease,
                           last_heartbeat_at = now(), attempt_count = d.attempt_count + 1,
                           progress = NULL
                     WHERE d.ctid = ANY (v_picked)
                    RETURNING d.id, d.message_id, d.lease_token, d.lease_expires_at,
                              d.attempt_count::integer, d.is_replay, d.visible_at
                )
                SELECT 'Claimed'::text, c.id, c.lease_token, c.lease_expires_at,
                       c.attempt_count, c.is_replay, m.id, m.topic_id, m.partition_key::text,
                       m.attributes, m.payload, m.payload_ref, m.correlation_id::text,
                       m.published_at
                  FROM claimed c
                 CROSS JOIN LATERAL (
                       -- A per-row probe by primary key, as in the keyed claim below.
                       SELECT x.id, x.topic_id, x.partition_key, x.attributes, x.payload,
                              x.payload_ref, x.correlation_id, x.published_at
                         FROM workqueue_message x WHERE x.id = c.message_id OFFSET 0) m
                 ORDER BY c.visible_at;
                GET DIAGNOSTICS v_count = ROW_COUNT;
                v_remaining := v_remaining - v_count;
            END IF;
            IF v_remaining > 0 THEN
                -- Nothing more of this priority is claimable now (or nothing due before the
                -- waiting key): on to the next priority, or to the key.
                IF v_due_before = 'infinity' THEN
                    v_keyless_below := v_keyless_level;
                    v_keyless_known := false;
                ELSE
                    v_keyless_tried_for_key := true;
                END IF;
            END IF;
            CONTINUE;
        END IF;
        EXIT WHEN v_key IS NULL;

        -- The key's turn. Whatever comes of it, the next turn takes the next key; a key the
        -- walk found is where the walk has got to only now.
        v_key_tried := v_key;
        v_key := NULL;
        v_keyless_tried_for_key := false;
        IF v_walked_key THEN
            v_walked_to := v_key_tried;
        END IF;

        -- Never wait on another claimer: waiting while holding this call's earlier claims
        -- can deadlock two claimers that meet keys in different orders. A key another
        -- claimer is working on, or a row someone else has locked, is skipped this time.
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended(
            'wq-claim:' || lower(p_subscription_id::text) || ':' || v_key_tried, 0));
        SELECT r.ctid INTO v_candidate_row
          FROM workqueue_delivery r WHERE r.id = v_candidate_id FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        BEGIN
            RETURN QUERY
            WITH claimed AS (
                UPDATE workqueue_delivery d
                   SET status = 'InFlight', lease_owner = p_lease_owner,
                       lease_token = CASE WHEN p_claim_id IS NULL THEN gen_random_uuid()
                           ELSE substr(encode(sha256(convert_to(
                                    p_claim_id::text || d.id::text, 'UTF8')), 'hex'),
                                       1, 32)::uuid END,
                       lease_expires_at = now() + v_lease,
                       last_heartbeat_at = now(), attempt_count = d.attempt_count + 1,
                       progress = NULL
                 -- By the locked row's ctid (it cannot move while locked): with a status
                 -- test in the statement, stale statistics can make the planner walk
                 -- wq_dlv_claim_keyed_pri_ix for it instead of one primary-key probe.
                 WHERE d.ctid = v_candidate_row AND d.status = 'Pending'
                   AND d.visible_at <= now() AND d.cancel_requested_at IS NULL
                   AND NOT EXISTS (
                       SELECT 1 FROM workqueue_delivery f
                        WHERE f.subscription_id = d.subscription_id
                          AND f.partition_key = d.partition_key AND f.status = 'InFlight')
                   -- Nor while a completed delivery of the key holds it: its handler, which
                   -- completed in its own transaction, still runs (wq_complete_holding_key).
                   AND NOT EXISTS (
                       SELECT 1 FROM workqueue_delivery k
                        WHERE k.subscription_id = d.subscription_id
                          AND k.partition_key = d.partition_key AND k.status = 'Completed'
                          AND k.lease_expires_at > now())
                   AND (NOT v_ordered OR NOT EXISTS (
                       SELECT 1 FROM workqueue_delivery h
                        WHERE h.subscription_id = d.subscription_id
                          AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                          AND h.status IN ('Pending', 'InFlight', 'DeadLettered')))
                RETURNING d.id, d.message_id, d.lease_token, d.lease_expires_at,
                          d.attempt_count::integer, d.is_replay
            )
            SELECT 'Claimed'::text, c.id, c.lease_token, c.lease_expires_at, c.attempt_count,
                   c.is_replay, m.id, m.topic_id, m.partition_key::text, m.attributes, m.payload,
                   m.payload_ref, m.correlation_id::text, m.published_at
              FROM claimed c
             CROSS JOIN LATERAL (
                   -- By primary key for each claimed row (OFFSET 0 keeps it a per-row probe:
                   -- joined plainly, stale statistics can make the planner scan messages).
                   SELECT x.id, x.topic_id, x.partition_key, x.attributes, x.payload,
                          x.payload_ref, x.correlation_id, x.published_at
                     FROM workqueue_message x WHERE x.id = c.message_id OFFSET 0) m;
            IF FOUND THEN
                v_remaining := v_remaining - 1;
            END IF;
        EXCEPTION WHEN unique_violation THEN
            -- Another consumer put this key in flight first; skip only this candidate.
            NULL;
        END;
    END LOOP;

    -- A key the walk found that still waits as the claim fills up is passed over when keyless
    -- work of a higher priority kept it waiting (the keys after it, which may rank higher,
    -- must not wait behind it claim after claim), and kept for the next claim when only older
    -- keyless work of its own priority did (its turn is near).
    IF v_key IS NOT NULL AND v_walked_key AND v_keyless_level > v_key_level THEN
        v_walked_to := v_key;
    END IF;
    IF v_walked_to IS NOT NULL THEN
        RETURN QUERY
        SELECT 'KeyCursor'::text, NULL::uuid, NULL::uuid, NULL::timestamptz, NULL::integer,
               NULL::boolean, NULL::uuid, NULL::uuid, v_walked_to, NULL::jsonb, NULL::jsonb,
               NULL::jsonb, NULL::text, NULL::timestamptz;
    END IF;

    IF v_remaining < v_max_rows THEN
        RETURN QUERY
        SELECT 'Lease'::text, NULL::uuid, NULL::uuid, NULL::timestamptz, v_sub.lease_seconds,
               NULL::boolean, NULL::uuid, NULL::uuid, NULL::text, NULL::jsonb, NULL::jsonb,
               NULL::jsonb, NULL::text, NULL::timestamptz;
    END IF;
END;
$$;
