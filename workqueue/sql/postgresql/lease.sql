-- Leases: the holder's heartbeat.
-- A plan kept for the session may have been made while the table was nearly empty: sequential
-- scans are left aside, so that a heartbeat still finds its row by primary key after a burst.

-- wq_extend_lease --
-- Renew a held lease, fenced by the lease token; replace the progress only when one is given.
-- Progress of more than 16,000 characters of JSON is stored as a note saying so: the runtime
-- keeps it within 4,000, and a holder calling the procedure itself must not make every read
-- of the delivery carry megabytes (review helper-173), as error text is cut where it is stored.
-- The renewal is as long as the lease it renews (its expiry less the time it was claimed or last
-- renewed), or the subscription's lease_seconds when that is longer: a lease shortened while the
-- delivery is held would otherwise run out between the holder's renewals, which it times by the
-- length the claim gave it, and another consumer would run the delivery beside it. Returns one
-- row: lease_state Held (with the new expiry), Cancelled (an operator asked to cancel; the holder
-- should stop and acknowledge; the lease is renewed all the same, with its new expiry: a handler
-- that has not stopped yet is still running, and its Exclusive or Ordered key must not be freed
-- for the next delivery beside it) or Lost (the token no longer holds the delivery).
CREATE OR REPLACE FUNCTION wq_extend_lease(
    p_delivery_id uuid,
    p_lease_token uuid,
    p_progress jsonb
)
RETURNS TABLE (lease_state text, lease_expires_at timestamptz)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
    v_cancelled boolean;
BEGIN
    UPDATE workqueue_delivery d
       SET lease_expires_at = now() + GREATEST(make_interval(secs => s.lease_seconds),
                                               d.lease_expires_at - d.last_heartbeat_at),
           last_heartbeat_at = now(),
           progress = COALESCE(CASE WHEN length(p_progress::text) > 16000
                                    THEN jsonb_build_object('omitted', 'progress over 16000 characters')
                                    ELSE p_progress END,
                               d.progress)
      FROM workqueue_subscription s
     WHERE d.id = p_delivery_id AND d.lease_token = p_lease_token
       -- Or a delivery completed in its handler's transaction whose handler runs on, holding
       -- its key (wq_complete_holding_key) for as long as it is renewed: a live hold only. A
       -- claim of the key takes no row of the hold's, so a hold renewed once it had lapsed
       -- could be the key's second holder (review helper-196).
       AND (d.status = 'InFlight'
            OR (d.status = 'Completed' AND d.lease_expires_at > now()))
       AND s.id = d.subscription_id
    RETURNING d.lease_expires_at, d.cancel_requested_at IS NOT NULL INTO v_expires, v_cancelled;
    IF FOUND THEN
        RETURN QUERY SELECT CASE WHEN v_cancelled THEN 'Cancelled' ELSE 'Held' END, v_expires;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'Lost'::text, NULL::timestamptz;
END;
$$;
