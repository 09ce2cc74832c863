-- Settling: the holder's final word on a delivery. Each is ONE statement fenced by
-- (delivery id, lease token, InFlight, no cancel request); affected_rows = 1 means it took effect,
-- 0 means the caller no longer holds the lease (LeaseLost). Every settle clears the lease.
-- PL/pgSQL rather than SQL functions: PL/pgSQL keeps its statement plans for the session, while
-- PostgreSQL 15 re-plans a SQL function's body on every call (more than the update costs here).
-- A plan kept for the session may have been made while the table was nearly empty, when reading
-- it end to end looked cheapest: every function here leaves sequential scans aside, so that a
-- settle still finds its row by primary key after a burst has filled the table.
-- What a settle records happening (completed_at, dead_lettered_at) is dated by its call
-- (statement_timestamp), not now(): a completion enlisted in a handler's transaction runs at its
-- end, and now() is that transaction's start, its first query (a task that queried, then worked
-- for an hour, read as completed when it began; until 0052). A due time (a retry's or a
-- release's visible_at) stays on now(), the clock claims compare with: inside a test's
-- transaction, where now() stands still, a retry dated by its call was never due again.

-- wq_complete --
-- InFlight → Completed.
CREATE OR REPLACE FUNCTION wq_complete(p_delivery_id uuid, p_lease_token uuid)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET status = 'Completed', completed_at = statement_timestamp(),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'InFlight'
       AND d.cancel_requested_at IS NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_complete_holding_key --
-- InFlight → Completed, as wq_complete, from inside a handler's own transaction (its
-- context.complete(enlist=True)), whose handler runs on after the commit: a keyed delivery keeps
-- its lease (owner, token, expiry), which holds its partition key (wq_claim starts none of the
-- key's deliveries while a Completed row of it holds an unexpired lease, which its holder goes
-- on renewing) until the handler returns (wq_release_key) or the lease ends (a host that died).
-- Completed at the commit all
-- the same: the work never runs again (review helper-193: the key's next delivery started
-- beside the handler's code after its block).
CREATE OR REPLACE FUNCTION wq_complete_holding_key(p_delivery_id uuid, p_lease_token uuid)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    -- The hold starts with a whole lease from the call (a block may have outlasted the lease
    -- it had): the holder renews it (wq_extend_lease) until its handler returns.
    UPDATE workqueue_delivery d
       SET status = 'Completed', completed_at = statement_timestamp(),
           lease_owner = CASE WHEN d.partition_key IS NULL THEN NULL ELSE d.lease_owner END,
           lease_token = CASE WHEN d.partition_key IS NULL THEN NULL ELSE d.lease_token END,
           lease_expires_at = CASE WHEN d.partition_key IS NULL THEN NULL
                                   ELSE GREATEST(d.lease_expires_at, statement_timestamp()
                                                 + make_interval(secs => s.lease_seconds)) END,
           last_heartbeat_at = CASE WHEN d.partition_key IS NULL THEN d.last_heartbeat_at
                                    ELSE statement_timestamp() END
      FROM workqueue_subscription s
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'InFlight'
       AND d.cancel_requested_at IS NULL AND s.id = d.subscription_id;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_release_key --
-- The handler of a delivery completed by wq_complete_holding_key has returned: its partition
-- key is free again. Fenced by the lease token; 0 rows when the lease had ended already.
CREATE OR REPLACE FUNCTION wq_release_key(p_delivery_id uuid, p_lease_token uuid)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'Completed';
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_complete_many --
-- Complete a JSON array of {"delivery_id", "lease_token"} pairs in one statement, each fenced
-- exactly as wq_complete. Returns the ids that were completed; a missing id lost its lease.
-- The statement keeps one plan per session (plan_cache_mode below). Left to choose, PostgreSQL
-- either planned it afresh for every batch (about 0.3 ms of backend CPU per call, more than
-- completing eight deliveries) or settled, depending on a session's first batches and the
-- statistics, on a plan that reads wq_dlv_open_ix for every InFlight entry of every
-- subscription, and every dead entry a busy table leaves there; or, made while the table was
-- small, one that hashed the whole table on every batch after it had grown. The plan it keeps
-- reads only the items' own rows, whatever the statistics say: the batch's ids are looked up in
-- the primary key first (id = ANY), so however the rows are then joined to their tokens, no
-- other row is read; the status fence compares with a variable, which a generic plan cannot
-- match against the partial indexes' predicates (status = 'InFlight'), so the primary key is
-- the one index that fits; sequential and bitmap scans are left aside.
CREATE OR REPLACE FUNCTION wq_complete_many(p_items jsonb)
RETURNS TABLE (delivery_id uuid)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_in_flight text := 'InFlight';
BEGIN
    RETURN QUERY
    UPDATE workqueue_delivery d
       SET status = 'Completed', completed_at = statement_timestamp(),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
      FROM jsonb_to_recordset(p_items) AS i(delivery_id uuid, lease_token uuid)
     WHERE d.id = ANY (ARRAY(SELECT x.delivery_id
                               FROM jsonb_to_recordset(p_items) AS x(delivery_id uuid)))
       AND d.id = i.delivery_id AND d.lease_token = i.lease_token AND d.status = v_in_flight
       AND d.cancel_requested_at IS NULL
    RETURNING d.id;
END;
$$;

-- wq_retry --
-- InFlight → Pending, visible again after p_delay_seconds; the attempt stays counted; the error
-- text, cut to 16,000 characters as the runtime cuts it, replaces last_error.
CREATE OR REPLACE FUNCTION wq_retry(
    p_delivery_id uuid,
    p_lease_token uuid,
    p_delay_seconds integer,
    p_error text
)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET status = 'Pending',
           visible_at = now() + make_interval(secs => GREATEST(p_delay_seconds, 0)),
           last_error = left(p_error, 16000),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'InFlight'
       AND d.cancel_requested_at IS NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_dead_letter --
-- InFlight → DeadLettered with a short reason (≤ 100 characters); the error text (cut to 16,000
-- characters) replaces last_error only when given. A dead letter waits for an operator to
-- replay or discard it.
CREATE OR REPLACE FUNCTION wq_dead_letter(
    p_delivery_id uuid,
    p_lease_token uuid,
    p_reason text,
    p_error text
)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET status = 'DeadLettered', dead_letter_reason = left(p_reason, 100),
           dead_lettered_at = statement_timestamp(),
           last_error = COALESCE(left(p_error, 16000), d.last_error),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'InFlight'
       AND d.cancel_requested_at IS NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_release --
-- InFlight → Pending, visible now, with the attempt refunded (used when a host shuts down).
CREATE OR REPLACE FUNCTION wq_release(p_delivery_id uuid, p_lease_token uuid)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET status = 'Pending', visible_at = now(),
           attempt_count = GREATEST(d.attempt_count - 1, 0),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'InFlight'
       AND d.cancel_requested_at IS NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;

-- wq_acknowledge_cancel --
-- The holder confirms it stopped a cancelled delivery: InFlight with a cancel request →
-- Discarded at once, which frees an Exclusive/Ordered key. The only settle that requires the
-- cancel flag; the token still fences it.
CREATE OR REPLACE FUNCTION wq_acknowledge_cancel(p_delivery_id uuid, p_lease_token uuid)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_rows integer;
BEGIN
    UPDATE workqueue_delivery d
       SET status = 'Discarded', completed_at = statement_timestamp(),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token AND d.status = 'InFlight'
       AND d.cancel_requested_at IS NOT NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN QUERY SELECT v_rows;
END;
$$;
