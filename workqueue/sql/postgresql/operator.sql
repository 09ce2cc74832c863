-- Operator reads and actions. Reads are bounded (keyset pages, capped counts); actions are single
-- guarded statements whose affected_rows says whether they took effect. The acting user's name
-- and the note are recorded on the delivery.
-- The PL/pgSQL functions here (and wq_queue_gauges, which calls one) leave sequential scans
-- aside: a web or metrics process keeps its connection, PL/pgSQL keeps each statement's plan for
-- the session, and a plan made while the tables were nearly empty must still read by index
-- once a burst has filled them. (The SQL functions are planned afresh on every call.)

-- wq_queue_gauges --
-- What a metrics scrape reads for one subscription, at a cost bounded whatever the backlog:
-- Pending, InFlight and DeadLettered deliveries and Ordered keys blocked by a dead-lettered head
-- (NULL for other modes), each counted up to p_cap (clamped to 1..1000000; NULL: 10000), and the
-- age in whole seconds of the oldest Pending delivery (never negative; NULL when none), read
-- from the first entry of each priority in each claim index. No row when the subscription does
-- not exist. Waits at most 2 s for a lock (a queue table locked by VACUUM FULL or a migrate's
-- ALTER TABLE), then fails with SQLSTATE 55P03: a scrape answers without the gauges rather than
-- hold a web worker and a session for as long as the lock is held (reviews helper-185, -186).
CREATE OR REPLACE FUNCTION wq_queue_gauges(p_subscription_id uuid, p_cap integer)
RETURNS TABLE (
    pending bigint,
    in_flight bigint,
    dead_lettered bigint,
    blocked_keys bigint,
    oldest_pending_age_seconds bigint
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET enable_seqscan = off
SET jit = off
AS $$
    WITH cap AS (SELECT LEAST(GREATEST(coalesce(p_cap, 10000), 1), 1000000) AS n)
    -- Each count is ordered as its index is (claim indexes, wq_dlv_open_ix,
    -- wq_dlv_dead_letter_ix), so the planner walks that index rather than scanning the table
    -- for the first rows that match, which reads other subscriptions' rows first.
    SELECT
        -- Keyless and keyed apart, each along its own claim index.
        LEAST((SELECT count(*) FROM (
                   SELECT 1 FROM workqueue_delivery d
                    WHERE d.subscription_id = p_subscription_id AND d.status = 'Pending'
                      AND d.partition_key IS NULL
                    ORDER BY d.priority, d.visible_at
                    LIMIT (SELECT n FROM cap)) AS x)
              + (SELECT count(*) FROM (
                   SELECT 1 FROM workqueue_delivery d
                    WHERE d.subscription_id = p_subscription_id AND d.status = 'Pending'
                      AND d.partition_key IS NOT NULL
                    ORDER BY d.priority, d.visible_at
                    LIMIT (SELECT n FROM cap)) AS x),
              (SELECT n FROM cap)),
        -- With the handlers that completed in their own transaction and still run, holding
        -- their keys (wq_complete_holding_key), as wq_backlog counts them.
        LEAST((SELECT count(*) FROM (
                   SELECT 1 FROM workqueue_delivery d
                    WHERE d.subscription_id = p_subscription_id AND d.status = 'InFlight'
                    ORDER BY d.status
                    LIMIT (SELECT n FROM cap)) AS x)
              + (SELECT count(*) FROM (
                   SELECT 1 FROM workqueue_delivery d
                    WHERE d.subscription_id = p_subscription_id AND d.status = 'Completed'
                      AND d.lease_expires_at > now()
                    LIMIT (SELECT n FROM cap)) AS x),
              (SELECT n FROM cap)),
        (SELECT count(*) FROM (
            SELECT 1 FROM workqueue_delivery d
             WHERE d.subscription_id = p_subscription_id AND d.status = 'DeadLettered'
             ORDER BY d.id
             LIMIT (SELECT n FROM cap)) AS x),
        CASE WHEN s.partition_mode = 'Ordered' THEN (
            SELECT count(DISTINCT x.partition_key) FROM (
                SELECT d.partition_key FROM workqueue_delivery d
                 WHERE d.subscription_id = p_subscription_id AND d.status = 'DeadLettered'
                   AND d.partition_key IS NOT NULL
                   AND NOT EXISTS (
                       SELECT 1 FROM workqueue_delivery h
                        WHERE h.subscription_id = d.subscription_id
                          AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                          AND h.status IN ('Pending', 'InFlight', 'DeadLettered'))
                 LIMIT (SELECT n FROM cap)) AS x)
        END,
        -- The oldest first entry of each priority present in each claim index (keyed and
        -- keyless Pending rows apart), the priorities found one probe at a time.
        (WITH RECURSIVE levels(keyed, priority) AS (
             SELECT k, wq_next_priority(p_subscription_id, k, 101)
               FROM (VALUES (true), (false)) AS v(k)
             UNION ALL
             SELECT l.keyed, wq_next_priority(p_subscription_id, l.keyed, l.priority)
               FROM levels l
              WHERE l.priority IS NOT NULL
         )
         -- NULL when nothing is pending (GREATEST would make that 0: it skips NULLs).
         SELECT CASE WHEN o.oldest IS NOT NULL THEN
                    GREATEST(floor(extract(epoch FROM now() - o.oldest)), 0)::bigint END
           FROM (SELECT min(
                        -- Two subqueries, so each names its partial index's predicate as it is.
                        CASE WHEN l.keyed THEN
                            (SELECT d.visible_at FROM workqueue_delivery d
                              WHERE d.subscription_id = p_subscription_id
                                AND d.status = 'Pending' AND d.partition_key IS NOT NULL
                                AND d.priority = l.priority
                              ORDER BY d.visible_at LIMIT 1)
                        ELSE
                            (SELECT d.visible_at FROM workqueue_delivery d
                              WHERE d.subscription_id = p_subscription_id
                                AND d.status = 'Pending' AND d.partition_key IS NULL
                                AND d.priority = l.priority
                              ORDER BY d.visible_at LIMIT 1)
                        END) AS oldest
                   FROM levels l
                  WHERE l.priority IS NOT NULL) AS o)
      FROM workqueue_subscription s
     WHERE s.id = p_subscription_id;
$$;

-- wq_subscription_stats --
-- What wq_queue_gauges reads for one subscription (Pending, InFlight and DeadLettered deliveries,
-- Ordered keys blocked by a dead-lettered head, the age of the oldest Pending delivery), with
-- its completions in the last hour and the database clock, each count made up to p_cap
-- (clamped to 1..1000000; NULL: 1000000), along the subscription's own index entries, so that
-- a caller allowed to read one small subscription cannot have the whole table read (the
-- completions among the hour's settled rows, Completed or Discarded, up to the cap). capped is
-- true when a count stopped there. No row when the subscription does not exist.
-- Until 0045 the counts were exact, each a scan of what they counted (and of every
-- subscription's rows for the completions and the Pending rows), and there was no p_cap; until
-- 0048 the completions were counted among the newest p_cap of every subscription's.
CREATE OR REPLACE FUNCTION wq_subscription_stats(
    p_subscription_id uuid,
    p_cap integer DEFAULT NULL
)
RETURNS TABLE (
    pending bigint,
    in_flight bigint,
    dead_lettered bigint,
    blocked_keys bigint,
    oldest_pending_age_seconds bigint,
    completed_last_hour bigint,
    as_of timestamptz,
    capped boolean
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
    WITH cap AS (SELECT LEAST(GREATEST(coalesce(p_cap, 1000000), 1), 1000000) AS n),
    -- The hour's settled rows, Completed or Discarded as the index holds them, up to the cap:
    -- a bulk discard's million Discarded rows must not be read past it either.
    recent AS (
        SELECT count(*) AS examined, count(*) FILTER (WHERE r.status = 'Completed') AS completed
          FROM (SELECT d.status FROM workqueue_delivery d
                 WHERE d.subscription_id = p_subscription_id
                   AND d.status IN ('Completed', 'Discarded')
                   AND d.completed_at > now() - interval '1 hour'
                 LIMIT (SELECT n FROM cap)) AS r
    )
    SELECT g.pending, g.in_flight, g.dead_lettered, g.blocked_keys,
           g.oldest_pending_age_seconds, recent.completed, now(),
           GREATEST(g.pending, g.in_flight, g.dead_lettered, coalesce(g.blocked_keys, 0),
                    recent.examined) >= (SELECT n FROM cap)
      FROM wq_queue_gauges(p_subscription_id, (SELECT n FROM cap)) AS g, recent;
$$;

-- wq_list_dead_letters --
-- One keyset page (by delivery id, ascending, after p_after_delivery_id) of a subscription's
-- dead letters with their messages. blocks_key is true for an Ordered key's head. The page is
-- clamped to 0..1000 rows (NULL: 1000): the roles that may call this cannot ask for them all.
-- p_with_payload false leaves payload and payload_ref NULL: a caller who may not see payloads
-- does not have up to a thousand of them read and sent to be thrown away (added in 0040, with
-- a default, so a caller of the three-parameter form reads on).
CREATE OR REPLACE FUNCTION wq_list_dead_letters(
    p_subscription_id uuid,
    p_after_delivery_id uuid,
    p_page_size integer,
    p_with_payload boolean DEFAULT true
)
RETURNS TABLE (
    delivery_id uuid,
    attempt_count integer,
    dead_letter_reason text,
    last_error text,
    dead_lettered_at timestamptz,
    partition_key text,
    blocks_key boolean,
    message_id uuid,
    topic_name text,
    message_partition_key text,
    attributes jsonb,
    payload jsonb,
    payload_ref jsonb,
    correlation_id text,
    published_at timestamptz
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.id, d.attempt_count, d.dead_letter_reason, d.last_error, d.dead_lettered_at,
           d.partition_key,
           (s.partition_mode = 'Ordered' AND d.partition_key IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM workqueue_delivery h
                WHERE h.subscription_id = d.subscription_id
                  AND h.partition_key = d.partition_key AND h.order_key < d.order_key
                  AND h.status IN ('Pending', 'InFlight', 'DeadLettered'))),
           m.id, t.name, m.partition_key, m.attributes,
           CASE WHEN p_with_payload IS NOT false THEN m.payload END,
           CASE WHEN p_with_payload IS NOT false THEN m.payload_ref END,
           m.correlation_id, m.published_at
      FROM workqueue_delivery d
      JOIN workqueue_subscription s ON s.id = d.subscription_id
      JOIN workqueue_message m ON m.id = d.message_id
      JOIN workqueue_topic t ON t.id = m.topic_id
     WHERE d.subscription_id = p_subscription_id AND d.status = 'DeadLettered'
       AND (p_after_delivery_id IS NULL OR d.id > p_after_delivery_id)
     ORDER BY d.id
     LIMIT LEAST(GREATEST(coalesce(p_page_size, 1000), 0), 1000);
$$;

-- wq_list_partitions --
-- One keyset page (by partition key, after p_after_partition_key) of a subscription's keys that
-- have open deliveries, as rows of kind 'Partition'. condition: InFlight when any delivery of
-- the key is in flight, else Blocked when an Ordered key's head is dead-lettered, else Idle.
-- p_condition NULL lists only the keys that are not Idle. head_delivery_id is the key's earliest
-- open delivery; waiting_items counts the Pending ones among its 1000 oldest open deliveries.
-- The keys are walked one probe of wq_dlv_partition_head_ix at a time (wq_next_open_key), for
-- a page clamped to 0..1000 (NULL: 1000) and at most 4 × page + 64 keys: when that budget runs
-- out before the page is full, a last row of kind 'KeyCursor' carries the last key looked at,
-- where the next page goes on. A call therefore costs what its page allows, however many keys
-- (idle ones included) the subscription has.
-- Until 0009 the function returned no kind column; a result shape cannot be replaced in place.
DO $drop_old_shape$
BEGIN
    IF pg_get_function_result(to_regprocedure('wq_list_partitions(uuid,text,text,integer)'))
       NOT LIKE 'TABLE(kind text,%' THEN
        DROP FUNCTION wq_list_partitions(uuid, text, text, integer);
    END IF;
END
$drop_old_shape$;

CREATE OR REPLACE FUNCTION wq_list_partitions(
    p_subscription_id uuid,
    p_condition text,
    p_after_partition_key text,
    p_page_size integer
)
RETURNS TABLE (
    kind text,
    partition_key text,
    condition text,
    head_delivery_id uuid,
    waiting_items bigint
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_page integer := LEAST(GREATEST(coalesce(p_page_size, 1000), 0), 1000);
    v_steps integer;
    v_ordered boolean;
    v_key text := p_after_partition_key;
    v_head record;
    v_condition text;
    v_listed integer := 0;
BEGIN
    SELECT s.partition_mode = 'Ordered' INTO v_ordered
      FROM workqueue_subscription s WHERE s.id = p_subscription_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_steps := v_page * 4 + 64;
    WHILE v_listed < v_page LOOP
        IF v_steps = 0 THEN
            RETURN QUERY SELECT 'KeyCursor'::text, v_key, NULL::text, NULL::uuid, NULL::bigint;
            RETURN;
        END IF;
        v_steps := v_steps - 1;
        v_key := wq_next_open_key(p_subscription_id, v_key);
        EXIT WHEN v_key IS NULL;
        SELECT h.id, h.status INTO v_head
          FROM workqueue_delivery h
         WHERE h.subscription_id = p_subscription_id AND h.partition_key = v_key
           AND h.status IN ('Pending', 'InFlight', 'DeadLettered')
         ORDER BY h.order_key
         LIMIT 1;
        v_condition := CASE
            WHEN EXISTS (SELECT 1 FROM workqueue_delivery f
                          WHERE f.subscription_id = p_subscription_id
                            AND f.partition_key = v_key AND f.status = 'InFlight')
                THEN 'InFlight'
            -- Completed in its handler's transaction, whose handler still runs and holds the
            -- key (wq_complete_holding_key).
            WHEN EXISTS (SELECT 1 FROM workqueue_delivery k
                          WHERE k.subscription_id = p_subscription_id
                            AND k.partition_key = v_key AND k.status = 'Completed'
                            AND k.lease_expires_at > now())
                THEN 'InFlight'
            WHEN v_ordered AND v_head.status = 'DeadLettered' THEN 'Blocked'
            ELSE 'Idle' END;
        CONTINUE WHEN CASE WHEN p_condition IS NULL THEN v_condition = 'Idle'
                           ELSE v_condition <> p_condition END;
        v_listed := v_listed + 1;
        -- Every open status in the test leaves wq_dlv_partition_head_ix as the only index that
        -- fits (with stale statistics the planner would otherwise filter the subscription's
        -- whole keyed backlog in wq_dlv_claim_keyed_pri_ix for this one key).
        RETURN QUERY
        SELECT 'Partition'::text, v_key, v_condition, v_head.id,
               count(*) FILTER (WHERE o.status = 'Pending')
          FROM (SELECT w.status FROM workqueue_delivery w
                 WHERE w.subscription_id = p_subscription_id AND w.partition_key = v_key
                   AND w.status IN ('Pending', 'InFlight', 'DeadLettered')
                 ORDER BY w.order_key
                 LIMIT 1000) AS o;
    END LOOP;
END;
$$;

-- wq_replay --
-- DeadLettered → Pending with attempts reset to 0 and is_replay set; the order key is kept, so a
-- replayed Ordered head keeps its place at the front of its key.
CREATE OR REPLACE FUNCTION wq_replay(
    p_subscription_id uuid,
    p_delivery_id uuid,
    p_actor text,
    p_note text
)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH changed AS (
        UPDATE workqueue_delivery d
           SET status = 'Pending', attempt_count = 0, is_replay = true, visible_at = now(),
               dead_letter_reason = NULL, dead_lettered_at = NULL,
               resolved_by = p_actor, resolution_note = left(p_note, 1000)
         WHERE d.id = p_delivery_id AND d.subscription_id = p_subscription_id
           AND d.status = 'DeadLettered'
        RETURNING 1
    )
    SELECT count(*)::integer FROM changed;
$$;

-- wq_discard --
-- DeadLettered (or Pending, when p_allow_pending) → Discarded. Never touches an InFlight row;
-- that needs wq_cancel. Waits at most 2 s for a row another transaction holds, then fails with
-- SQLSTATE 55P03 (an operator's request must not hang for as long as a handler keeps open the
-- transaction it completes its delivery in).
CREATE OR REPLACE FUNCTION wq_discard(
    p_subscription_id uuid,
    p_delivery_id uuid,
    p_allow_pending boolean,
    p_actor text,
    p_reason text
)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
    WITH changed AS (
        UPDATE workqueue_delivery d
           SET status = 'Discarded', completed_at = now(),
               resolved_by = p_actor, resolution_note = left(p_reason, 1000),
               lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         WHERE d.id = p_delivery_id AND d.subscription_id = p_subscription_id
           AND (d.status = 'DeadLettered' OR (p_allow_pending AND d.status = 'Pending'))
        RETURNING 1
    )
    SELECT count(*)::integer FROM changed;
$$;

-- wq_resolve_dead_letters --
-- One bounded batch of a bulk replay or discard: examines the subscription's next dead letters
-- by delivery id after p_after_delivery_id (at most p_batch_size, clamped to 1..5000; NULL:
-- 1000), and replays (p_action 'Replay', as wq_replay does) or discards ('Discard', as
-- wq_discard does) those matching every filter given (NULL matches all): the dead-letter reason
-- (ignoring case), the message's partition key (exactly, whatever the partition mode), the time
-- of the dead letter in [from, before), and the last error containing the text (ignoring case).
-- With p_dry_run nothing changes: changed reports how many would. last_delivery_id is where the
-- next batch starts; a batch that examined fewer rows than its size was the last. Each batch is
-- its own transaction, so a million dead letters never hold their locks together.
-- The batch is read without locking it, and a row is changed only while it is still the dead
-- letter the batch examined (its status and its dead_lettered_at): one replayed, run and
-- dead-lettered again meanwhile is another dead letter, which the filters have not matched.
-- Until 0060 the batch was locked while the call ran, a dry run's too, and a colleague's count
-- held up a real run and made a discard of one of its rows time out (review helper-183).
CREATE OR REPLACE FUNCTION wq_resolve_dead_letters(
    p_subscription_id uuid,
    p_action text,
    p_reason text,
    p_partition_key text,
    p_dead_lettered_from timestamptz,
    p_dead_lettered_before timestamptz,
    p_error_contains text,
    p_after_delivery_id uuid,
    p_batch_size integer,
    p_dry_run boolean,
    p_actor text,
    p_note text
)
RETURNS TABLE (examined integer, changed integer, last_delivery_id uuid)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_limit integer := LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000);
    v_ids uuid[];
    v_matching uuid[];
    v_matching_at timestamptz[];  -- when each matching one was dead-lettered
    v_changed integer := 0;
BEGIN
    IF p_action IS NULL OR p_action NOT IN ('Replay', 'Discard') THEN
        RAISE EXCEPTION 'wq_resolve_dead_letters: p_action must be Replay or Discard, not %',
            p_action USING ERRCODE = '22023';
    END IF;
    -- The batch, in id order along wq_dlv_dead_letter_ix.
    SELECT array_agg(w.id ORDER BY w.id),
           array_agg(w.id ORDER BY w.id) FILTER (WHERE w.matches),
           array_agg(w.dead_lettered_at ORDER BY w.id) FILTER (WHERE w.matches)
      INTO v_ids, v_matching, v_matching_at
      FROM (SELECT d.id, d.dead_lettered_at,
                   (p_reason IS NULL OR lower(d.dead_letter_reason) = lower(p_reason))
                   AND (p_partition_key IS NULL OR EXISTS (
                        SELECT 1 FROM workqueue_message m
                         WHERE m.id = d.message_id AND m.partition_key = p_partition_key))
                   AND (p_dead_lettered_from IS NULL OR d.dead_lettered_at >= p_dead_lettered_from)
                   AND (p_dead_lettered_before IS NULL OR d.dead_lettered_at < p_dead_lettered_before)
                   AND (p_error_contains IS NULL
                        OR strpos(lower(coalesce(d.last_error, '')), lower(p_error_contains)) > 0)
                   AS matches
              FROM workqueue_delivery d
             WHERE d.subscription_id = p_subscription_id AND d.status = 'DeadLettered'
               AND (p_after_delivery_id IS NULL OR d.id > p_after_delivery_id)
             ORDER BY d.id
             LIMIT v_limit) AS w;
    IF p_dry_run THEN
        v_changed := coalesce(cardinality(v_matching), 0);
    ELSIF p_action = 'Replay' THEN
        UPDATE workqueue_delivery d
           SET status = 'Pending', attempt_count = 0, is_replay = true, visible_at = now(),
               dead_letter_reason = NULL, dead_lettered_at = NULL,
               resolved_by = p_actor, resolution_note = left(p_note, 1000)
          FROM unnest(v_matching, v_matching_at) AS b(id, dead_lettered_at)
         WHERE d.id = b.id AND d.status = 'DeadLettered'
           AND d.dead_lettered_at IS NOT DISTINCT FROM b.dead_lettered_at;
        GET DIAGNOSTICS v_changed = ROW_COUNT;
    ELSE
        UPDATE workqueue_delivery d
           SET status = 'Discarded', completed_at = now(),
               resolved_by = p_actor, resolution_note = left(p_note, 1000),
               lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
          FROM unnest(v_matching, v_matching_at) AS b(id, dead_lettered_at)
         WHERE d.id = b.id AND d.status = 'DeadLettered'
           AND d.dead_lettered_at IS NOT DISTINCT FROM b.dead_lettered_at;
        GET DIAGNOSTICS v_changed = ROW_COUNT;
    END IF;
    RETURN QUERY SELECT coalesce(cardinality(v_ids), 0), v_changed, v_ids[cardinality(v_ids)];
END;
$$;

-- wq_discard_pending --
-- One bounded batch of a bulk discard of waiting work: walks the subscription's Pending
-- deliveries along one claim index (p_keyed: those with a partition key, else those without),
-- in (priority, visible_at, id) order after (p_after_priority, p_after_visible_at,
-- p_after_delivery_id), at most
-- p_batch_size of them (clamped to 1..5000; NULL: 1000), and discards those matching every
-- filter given (NULL matches all): the message's partition key (exactly), its publish time in
-- [from, before), and the last error of an earlier attempt containing the text (ignoring
-- case). Rows another session holds locked at that moment (a claim taking them) are examined
-- and skipped, never changed (they are being claimed: cancel them one by one). With p_dry_run
-- nothing changes and nothing is locked: changed reports how many would (until 0058 a dry
-- run locked what it walked too, and a real run beside it skipped those rows: review
-- helper-183). The last row examined is where the next batch starts; a batch that examined
-- fewer rows than its size was the last.
-- Until 0056 a locked row was skipped uncounted (SKIP LOCKED in the walk itself), and the
-- batch walked on until it had examined its size in rows no one held: behind rows held by
-- open transactions, as many as there were, in one call (review helper-176). Now the walk
-- reads its rows unlocked and locks each by its ctid, so a held one still counts.
-- A batch reads what it examines (and the rows sharing the first and last ones' due time), not
-- the rest of the backlog: each priority is walked as a range of due times, its far end the due
-- time of the row that fills the batch (read along the claim index), and only that range is
-- sorted by id. Until 0045 one statement ordered by (priority, visible_at, id), which the claim
-- index cannot give, so every batch read and sorted all of the subscription's rows after the
-- cursor: a bulk discard of a backlog of a million ran a thousand such batches (minutes).
CREATE OR REPLACE FUNCTION wq_discard_pending(
    p_subscription_id uuid,
    p_keyed boolean,
    p_partition_key text,
    p_published_from timestamptz,
    p_published_before timestamptz,
    p_error_contains text,
    p_after_priority integer,
    p_after_visible_at timestamptz,
    p_after_delivery_id uuid,
    p_batch_size integer,
    p_dry_run boolean,
    p_actor text,
    p_reason text
)
RETURNS TABLE (
    examined integer,
    changed integer,
    last_priority integer,
    last_visible_at timestamptz,
    last_delivery_id uuid
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_limit integer := LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000);
    v_key text := CASE WHEN p_keyed THEN 'NOT' ELSE '' END;
    -- Where the walk stands: a priority, and the due time and id last examined in it.
    v_priority integer := p_after_priority;
    v_after_at timestamptz := p_after_visible_at;
    v_after_id uuid := p_after_delivery_id;
    v_wanted integer;
    v_bound timestamptz;
    v_found integer;
    v_examined integer := 0;
    v_last_priority integer;
    v_last_visible_at timestamptz;
    v_last_id uuid;
    v_ids uuid[];
    v_matching uuid[] := '{}';
    v_changed integer := 0;
BEGIN
    IF v_after_at IS NULL OR v_priority IS NULL THEN
        v_priority := -32768;  -- before the lowest priority: the walk starts at the first one
        v_after_at := 'infinity';
    END IF;
    LOOP
        IF v_after_at = 'infinity' THEN
            -- This priority is done: on to the next one present (one probe of the index).
            EXECUTE format($probe$
                SELECT d.priority FROM workqueue_delivery d
                 WHERE d.subscription_id = $1 AND d.status = 'Pending'
                   AND d.partition_key IS %s NULL AND d.priority > $2
                 ORDER BY d.priority LIMIT 1
            $probe$, v_key) INTO v_priority USING p_subscription_id, v_priority;
            EXIT WHEN v_priority IS NULL;
            v_after_at := '-infinity';
            v_after_id := NULL;
        END IF;
        v_wanted := v_limit - v_examined;
        -- The due time of the row that fills the batch: rows up to it (those sharing it
        -- included) hold what the batch wants, and no row beyond it is read. Built per call so
        -- the key predicate is a literal the planner matches to the partial claim index.
        EXECUTE format($bound$
            SELECT d.visible_at FROM workqueue_delivery d
             WHERE d.subscription_id = $1 AND d.status = 'Pending'
               AND d.partition_key IS %s NULL AND d.priority = $2 AND d.visible_at > $3
             ORDER BY d.visible_at OFFSET $4 - 1 LIMIT 1
        $bound$, v_key) INTO v_bound USING p_subscription_id, v_priority, v_after_at, v_wanted;
        EXECUTE format($query$
            SELECT count(*),
                   (array_agg(w.visible_at ORDER BY w.visible_at DESC, w.id DESC))[1],
                   (array_agg(w.id ORDER BY w.visible_at DESC, w.id DESC))[1],
                   array_agg(w.id) FILTER (WHERE l.matches)
              FROM (SELECT d.id, d.visible_at, d.ctid AS row_at
                      FROM workqueue_delivery d
                     WHERE d.subscription_id = $1 AND d.status = 'Pending'
                       AND d.partition_key IS %s NULL AND d.priority = $9
                       AND d.visible_at >= $6 AND d.visible_at <= $10
                       AND (d.visible_at > $6 OR $7 IS NULL OR d.id > $7)
                     ORDER BY d.visible_at, d.id
                     LIMIT $8) AS w
              -- Each walked row locked by its ctid (a TID probe; read by this statement, so
              -- no other row can be there), unless another session holds it or has changed it.
              -- Not on a dry run, which changes nothing: its locks made a real run beside it
              -- skip the rows as being claimed, and leave them to run (review helper-183).
              LEFT JOIN LATERAL (
                    SELECT ($5 IS NULL
                            OR strpos(lower(coalesce(x.last_error, '')), lower($5)) > 0)
                           AND ($2 IS NULL AND $3 IS NULL AND $4 IS NULL OR EXISTS (
                               SELECT 1 FROM workqueue_message m
                                WHERE m.id = x.message_id
                                  AND ($2 IS NULL OR m.partition_key = $2)
                                  AND ($3 IS NULL OR m.published_at >= $3)
                                  AND ($4 IS NULL OR m.published_at < $4)))
                           AS matches
                      FROM workqueue_delivery x
                     WHERE x.ctid = w.row_at AND x.status = 'Pending'
                       %s) AS l ON true
        $query$, v_key, CASE WHEN p_dry_run THEN '' ELSE 'FOR UPDATE SKIP LOCKED' END)
          INTO v_found, v_last_visible_at, v_last_id, v_ids
          USING p_subscription_id, p_partition_key, p_published_from, p_published_before,
                p_error_contains, v_after_at, v_after_id, v_wanted, v_priority,
                coalesce(v_bound, 'infinity'::timestamptz);
        IF v_found > 0 THEN
            v_examined := v_examined + v_found;
            v_last_priority := v_priority;
            v_matching := v_matching || coalesce(v_ids, '{}');
        END IF;
        EXIT WHEN v_examined >= v_limit;
        -- Fewer than wanted: every row up to the bound was examined (rows changed since the
        -- bound was read leave it short). The priority goes on past the bound, or is done.
        IF v_bound IS NULL THEN
            v_after_at := 'infinity';
        ELSE
            v_after_at := v_bound;
            v_after_id := 'ffffffff-ffff-ffff-ffff-ffffffffffff';
        END IF;
    END LOOP;
    IF p_dry_run THEN
        v_changed := cardinality(v_matching);
    ELSE
        UPDATE workqueue_delivery d
           SET status = 'Discarded', completed_at = now(),
               resolved_by = p_actor, resolution_note = left(p_reason, 1000)
         WHERE d.id = ANY (v_matching) AND d.status = 'Pending';
        GET DIAGNOSTICS v_changed = ROW_COUNT;
    END IF;
    RETURN QUERY SELECT v_examined, v_changed, v_last_priority, v_last_visible_at, v_last_id;
END;
$$;

-- wq_cancel --
-- Ask the holder of an InFlight delivery to stop: set the cancel flag (once) and record the
-- actor and reason. The lease token is left alone so the holder can acknowledge and free its key
-- at once; if it never does, lease expiry discards the delivery. A cancelled delivery never runs
-- again. Also a Completed delivery whose handler completed it in its own transaction and runs
-- on, holding its partition key (wq_complete_holding_key): it stays Completed, its handler is
-- told at its next renewal, and the key is free when the handler returns or the hold's lease
-- ends (until 0065 nothing reached such a handler: review helper-199). Hosts listening on
-- channel wq_cancel hear of it at commit. Waits at most 2 s for the row (held by a handler
-- completing the delivery in its own transaction), then fails with SQLSTATE 55P03, as
-- wq_discard does.
CREATE OR REPLACE FUNCTION wq_cancel(
    p_subscription_id uuid,
    p_delivery_id uuid,
    p_actor text,
    p_reason text
)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET cancel_requested_at = now(),
           resolved_by = p_actor, resolution_note = left(p_reason, 1000)
     WHERE d.id = p_delivery_id AND d.subscription_id = p_subscription_id
       AND (d.status = 'InFlight' OR (d.status = 'Completed' AND d.lease_expires_at > now()))
       AND d.cancel_requested_at IS NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    IF v_rows > 0 THEN
        -- Listening hosts check the delivery's lease at once instead of at the next heartbeat.
        PERFORM pg_notify('wq_cancel', lower(p_delivery_id::text));
    END IF;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_backlog --
-- What an autoscaler needs: claimable deliveries (visible keyless Pending rows, plus one per key
-- that could be claimed now under the subscription's partition mode; 0 unless the subscription is
-- Active and its topic and transport are too, as wq_claim decides) and InFlight rows (which run
-- to their end whatever those statuses), each counted up to p_cap, clamped to 0..1000 (NULL: 1000) since the
-- scaler role calls this directly. No row when the subscription does not exist. Keys are
-- counted by walking wq_dlv_partition_head_ix one key at a time (as wq_claim walks them), so a
-- hot key's blocked backlog costs one step, not its rows; the walk takes at most 4 × cap + 64
-- steps, so keys behind that many keys that cannot run now are left out of the count. Waits at
-- most 2 s for a lock, as wq_queue_gauges does (an autoscaler polls it too).
CREATE OR REPLACE FUNCTION wq_backlog(p_subscription_id uuid, p_cap integer)
RETURNS TABLE (claimable bigint, in_flight bigint)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_sub record;
    v_limit integer := LEAST(GREATEST(coalesce(p_cap, 1000), 0), 1000);
    v_steps integer := v_limit * 4 + 64;
    v_claimable bigint;
    v_level integer;
    v_key text;
    v_head record;
BEGIN
    -- A Disabled topic or transport stops claims as a Paused subscription does: an autoscaler
    -- must not start hosts for work none of them may claim.
    SELECT s.partition_mode,
           CASE WHEN t.status = 'Active' AND tr.status = 'Active' THEN s.status
                ELSE 'Paused' END AS status
      INTO v_sub
      FROM workqueue_subscription s
      JOIN workqueue_topic t ON t.id = s.topic_id
      JOIN workqueue_transport tr ON tr.id = t.transport_id
     WHERE s.id = p_subscription_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- With the handlers that completed in their own transaction and still run, holding
    -- their keys (wq_complete_holding_key).
    in_flight := LEAST((SELECT count(*) FROM (
        SELECT 1 FROM workqueue_delivery d
         WHERE d.subscription_id = p_subscription_id AND d.status = 'InFlight'
         LIMIT v_limit) AS held) + (SELECT count(*) FROM (
        SELECT 1 FROM workqueue_delivery d
         WHERE d.subscription_id = p_subscription_id AND d.status = 'Completed'
           AND d.lease_expires_at > now()
         LIMIT v_limit) AS holding), v_limit);
    IF v_sub.status <> 'Active' THEN
        claimable := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    -- Keyless rows already due, a priority at a time as wq_claim reads them, so rows
    -- scheduled for later are neither counted nor read.
    v_claimable := 0;
    v_level := 101;
    LOOP
        EXIT WHEN v_claimable >= v_limit;
        v_level := wq_next_priority(p_subscription_id, false, v_level);
        EXIT WHEN v_level IS NULL;
        v_claimable := v_claimable + (SELECT count(*) FROM (
            SELECT 1 FROM workqueue_delivery d
             WHERE d.subscription_id = p_subscription_id AND d.status = 'Pending'
               AND d.partition_key IS NULL AND d.priority = v_level AND d.visible_at <= now()
             LIMIT v_limit - v_claimable) AS keyless);
    END LOOP;

    IF v_sub.partition_mode <> 'None' THEN
        LOOP
            EXIT WHEN v_claimable >= v_limit OR v_steps <= 0;
            v_steps := v_steps - 1;
            v_key := wq_next_open_key(p_subscription_id, v_key);
            EXIT WHEN v_key IS NULL;
            IF v_sub.partition_mode = 'Ordered' THEN
                -- Claimable when the key's head is a visible Pending delivery.
                SELECT h.status, h.visible_at INTO v_head
                  FROM workqueue_delivery h
                 WHERE h.subscription_id = p_subscription_id AND h.partition_key = v_key
                   AND h.status IN ('Pending', 'InFlight', 'DeadLettered')
                 ORDER BY h.order_key
                 LIMIT 1;
                IF v_head.status = 'Pending' AND v_head.visible_at <= now()
                   AND NOT EXISTS (
                       SELECT 1 FROM workqueue_delivery k
                        WHERE k.subscription_id = p_subscription_id
                          AND k.partition_key = v_key AND k.status = 'Completed'
                          AND k.lease_expires_at > now()) THEN
                    v_claimable := v_claimable + 1;
                END IF;
            ELSIF NOT EXISTS (
                    SELECT 1 FROM workqueue_delivery f
                     WHERE f.subscription_id = p_subscription_id AND f.partition_key = v_key
                       AND f.status = 'InFlight')
              AND NOT EXISTS (
                    -- Nor a key held by a handler that completed in its own transaction.
                    SELECT 1 FROM workqueue_delivery k
                     WHERE k.subscription_id = p_subscription_id AND k.partition_key = v_key
                       AND k.status = 'Completed' AND k.lease_expires_at > now())
              AND EXISTS (
                    -- Fenced like wq_claim's candidate lookup, to keep to the key's index.
                    SELECT 1 FROM (SELECT c.status, c.visible_at
                                     FROM workqueue_delivery c
                                    WHERE c.subscription_id = p_subscription_id
                                      AND c.partition_key = v_key
                                      AND c.status IN ('Pending', 'InFlight', 'DeadLettered')
                                   OFFSET 0) o
                     WHERE o.status = 'Pending' AND o.visible_at <= now()) THEN
                v_claimable := v_claimable + 1;
            END IF;
        END LOOP;
    END IF;
    claimable := LEAST(v_claimable, v_limit);
    RETURN NEXT;
END;
$$;

-- wq_read_committed_snapshot_state --
-- Whether readers see committed data without blocking writers. Always true on PostgreSQL (MVCC);
-- present so that binding validation asks every vendor the same question.
CREATE OR REPLACE FUNCTION wq_read_committed_snapshot_state()
RETURNS TABLE (snapshot_on boolean)
LANGUAGE sql
IMMUTABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT true;
$$;

-- wq_retire_discard --
-- Retiring a subscription: up to p_batch_size (clamped to 1..5000; NULL: 1000, as the other
-- operator batches: until 0056 from below only, review helper-176) of its Pending and DeadLettered
-- deliveries -> Discarded, with the actor and reason recorded. Only for a Disabled subscription (no
-- new deliveries are fanned out to it, no host claims it); for any other it changes nothing.
-- InFlight rows are left to their holders.
CREATE OR REPLACE FUNCTION wq_retire_discard(
    p_subscription_id uuid,
    p_actor text,
    p_reason text,
    p_batch_size integer
)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH victims AS (
        SELECT d.id
          FROM workqueue_delivery d
          JOIN workqueue_subscription s ON s.id = d.subscription_id
         WHERE d.subscription_id = p_subscription_id AND s.status = 'Disabled'
           AND d.status IN ('Pending', 'DeadLettered')
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
           FOR UPDATE OF d SKIP LOCKED
    ), changed AS (
        UPDATE workqueue_delivery d
           SET status = 'Discarded', completed_at = now(),
               resolved_by = p_actor, resolution_note = left(p_reason, 1000),
               lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
          FROM victims v
         WHERE d.id = v.id AND d.status IN ('Pending', 'DeadLettered')
        RETURNING 1
    )
    SELECT count(*)::integer FROM changed;
$$;

-- wq_retire_purge --
-- Retiring a subscription: delete up to p_batch_size (clamped as wq_retire_discard's) of its
-- Completed and Discarded deliveries whatever their age, so its row can be deleted. Only for a
-- Disabled subscription; for any other it deletes nothing. Never a Pending, InFlight or
-- DeadLettered row, nor a Completed one whose handler runs on holding its key (its hold's
-- lease unexpired: review helper-199).
CREATE OR REPLACE FUNCTION wq_retire_purge(p_subscription_id uuid, p_batch_size integer)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH victims AS (
        SELECT d.id
          FROM workqueue_delivery d
          JOIN workqueue_subscription s ON s.id = d.subscription_id
         WHERE d.subscription_id = p_subscription_id AND s.status = 'Disabled'
           AND d.status IN ('Completed', 'Discarded')
           AND NOT (d.status = 'Completed' AND d.lease_expires_at IS NOT NULL
                    AND d.lease_expires_at > now())
         LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)
           FOR UPDATE OF d SKIP LOCKED
    ), deleted AS (
        DELETE FROM workqueue_delivery d USING victims v
         WHERE d.id = v.id AND d.status IN ('Completed', 'Discarded')
        RETURNING 1
    )
    SELECT count(*)::integer FROM deleted;
$$;
