-- Rate limits: one token bucket per rate-limited subscription, shared by every host. A host
-- takes tokens before it claims and claims no more deliveries than it was granted, so the
-- deliveries started per second across all hosts stay within the subscription's
-- rate_limit_per_second (plus its burst after a quiet spell). Over the limit, deliveries wait
-- Pending: nothing is failed or delayed on the row itself.

-- wq_take_rate_tokens --
-- Grant up to p_wanted tokens of the subscription's bucket, refilled first at its rate up to its
-- burst (rate_limit_burst, else the rate rounded up, at least 1). An unlimited (or unknown)
-- subscription is granted p_wanted at once. wait_ms says how long until a token is next due
-- (0 when something was granted); full_in_ms how long the bucket, as this take leaves it, takes
-- to refill to its burst (what wq_return_rate_tokens weighs tokens given back by; 0 when
-- unlimited). The bucket row is locked for this call only, so hosts take from it one at a time.
CREATE OR REPLACE FUNCTION wq_take_rate_tokens(p_subscription_id uuid, p_wanted integer)
RETURNS TABLE (granted integer, wait_ms integer, full_in_ms integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wanted integer := GREATEST(coalesce(p_wanted, 0), 0);
    v_rate double precision;
    v_burst double precision;
    v_now timestamptz;
    v_available double precision;
    v_granted integer;
BEGIN
    SELECT s.rate_limit_per_second,
           coalesce(s.rate_limit_burst, GREATEST(ceil(s.rate_limit_per_second), 1))
      INTO v_rate, v_burst
      FROM workqueue_subscription s
     WHERE s.id = p_subscription_id;
    IF v_rate IS NULL THEN
        RETURN QUERY SELECT v_wanted, 0, 0;
        RETURN;
    END IF;
    -- A new bucket starts full.
    INSERT INTO workqueue_rate_limit_bucket (subscription_id, tokens, refilled_at)
    VALUES (p_subscription_id, v_burst, clock_timestamp())
    ON CONFLICT (subscription_id) DO NOTHING;
    PERFORM 1 FROM workqueue_rate_limit_bucket b
     WHERE b.subscription_id = p_subscription_id
       FOR UPDATE;
    -- The clock is read only once the row is ours: a time read before waiting for the lock
    -- would be older than the refill the previous taker recorded, and count that time twice.
    v_now := clock_timestamp();
    SELECT LEAST(v_burst,
                 b.tokens + v_rate * GREATEST(extract(epoch FROM v_now - b.refilled_at), 0))
      INTO v_available
      FROM workqueue_rate_limit_bucket b
     WHERE b.subscription_id = p_subscription_id;
    v_granted := LEAST(v_wanted, floor(v_available)::integer);
    -- Refilled up to now, even when the clock has stepped back past the last refill (that
    -- step added nothing): kept ahead of the clock, the bucket would refill nothing until the
    -- clock caught up.
    UPDATE workqueue_rate_limit_bucket b
       SET tokens = v_available - v_granted, refilled_at = v_now
     WHERE b.subscription_id = p_subscription_id;
    RETURN QUERY SELECT v_granted,
                        CASE WHEN v_granted > 0 OR v_wanted = 0 THEN 0
                             ELSE ceil(1000 * (1 - (v_available - v_granted)) / v_rate)::integer
                        END,
                        -- At most a day (an integer): wq_return_rate_tokens reads a day as
                        -- "a day or more".
                        LEAST(floor(1000 * GREATEST(v_burst - (v_available - v_granted), 0)
                                    / v_rate), 86400000)::integer;
END;
$$;

-- wq_return_rate_tokens --
-- Give back tokens taken but not used (the claim found fewer deliveries than it was granted),
-- never filling the bucket past its burst. Nothing for an unlimited subscription. p_held_ms:
-- how long ago the tokens were asked for; p_full_in_ms: what the take answered. Only what the
-- bucket would hold had they never been taken comes back: left in it, they would have filled
-- it to its burst (p_full_in_ms - p_unused / rate) after the take, and what it refilled from
-- then on (which another host may have taken since) is not given again: rate * (p_full_in_ms
-- - p_held_ms) at most. Added in full, a claim that took a while gave a second burst at once
-- (review helper-166). A caller that does not say (the previous release) gives back all.
-- A take answers a day at most: then the bucket is a day or more from full, so at least the
-- unused tokens less what it refilled since the take (rate * p_held_ms) fit, or the day's
-- bound, whichever is more. Bounded by the day alone, a slow bucket lost tokens it never used:
-- at 0.001/s, 13 of 99 (review helper-185).
CREATE OR REPLACE FUNCTION wq_return_rate_tokens(
    p_subscription_id uuid,
    p_unused integer,
    p_held_ms integer DEFAULT NULL,
    p_full_in_ms integer DEFAULT NULL
)
RETURNS TABLE (affected_rows integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH changed AS (
        UPDATE workqueue_rate_limit_bucket b
           SET tokens = LEAST(
                   b.tokens + CASE
                       WHEN p_held_ms IS NULL OR p_full_in_ms IS NULL
                           THEN GREATEST(coalesce(p_unused, 0), 0)
                       WHEN p_full_in_ms >= 86400000
                           THEN GREATEST(coalesce(p_unused, 0) - s.rate_limit_per_second
                                                               * GREATEST(p_held_ms, 0) / 1000.0,
                                         LEAST(coalesce(p_unused, 0),
                                               s.rate_limit_per_second
                                               * (86400000 - p_held_ms) / 1000.0),
                                         0)
                       ELSE GREATEST(LEAST(coalesce(p_unused, 0),
                                           s.rate_limit_per_second
                                           * (p_full_in_ms - p_held_ms) / 1000.0), 0)
                   END,
                   coalesce(s.rate_limit_burst, GREATEST(ceil(s.rate_limit_per_second), 1)))
          FROM workqueue_subscription s
         WHERE b.subscription_id = p_subscription_id AND s.id = b.subscription_id
           AND s.rate_limit_per_second IS NOT NULL
        RETURNING 1
    )
    SELECT count(*)::integer FROM changed;
$$;
