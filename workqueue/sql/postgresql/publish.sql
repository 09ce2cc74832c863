-- Publishing: one guarded transaction per message that checks the topic, takes the ordered-publish
-- lock, reserves the deduplication key, inserts the message, fans it out to every matching
-- subscription in one set-based INSERT, confirms the key and wakes listening consumers.
-- The publish functions and those that read the deduplication ledger leave sequential scans
-- aside: PL/pgSQL keeps each statement's plan for the session, and one made while the ledger or
-- the message table was nearly empty would otherwise read all of it for every keyed publish, or
-- every retried batch, once a burst had filled it.
-- A deduplication window runs from the publish call (statement_timestamp()), as on SQL Server,
-- not from its transaction's start (now()): one enlisted late in a long transaction is not cut
-- short by how long the transaction ran before it. Publish and due times stay on now(), the
-- clock claims read: inside one transaction (a TestCase) what is published now is due now. A
-- delay_seconds runs from the call too, for the same reason as the windows.

CREATE SEQUENCE IF NOT EXISTS wq_publish_ordinal_seq;

-- wq_new_id --
-- A new row id: a time-ordered UUID (version 7: Unix time in milliseconds, then random bits),
-- for the deliveries and deduplication entries the procedures create. Rows created together sort
-- together, so each insert lands at the right-hand edge of the primary key (and a claim's or a
-- settle's new index entries next to it), on pages already in memory, instead of on a random
-- page of an ever larger index. Message ids are chosen the same way by the publisher
-- (workqueue.ids.new_message_id). Plain SQL without SET clauses, so callers inline it. The
-- milliseconds come from date_part (a double, exact to far below a millisecond until about
-- 2255), at half the cost of extract's numeric; both round to the nearest millisecond (a tie
-- at exactly half of one goes to the even one now, up before), which only orders ids.
CREATE OR REPLACE FUNCTION wq_new_id()
RETURNS uuid
LANGUAGE sql
VOLATILE
PARALLEL SAFE
AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    placing substring(int8send(
                        (date_part('epoch', clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),  -- version 0100 (4) becomes 0111 (7); the variant bits stay
        'hex')::uuid;
$$;

-- wq_id_clock, wq_id_random, wq_id_at --
-- The ids of the rows one statement creates in bulk (a batch's deliveries), made as RFC 9562
-- allows for a version 7 UUID generated in quantity: the 12 bits after the version hold the
-- fraction of the millisecond (its method 3), and the 62 bits after the variant start from one
-- strong random number for the statement (a clear bit of headroom, then 61 random bits) and
-- count up by one per row (its method 2). wq_new_id draws strong randomness for each id, which
-- costs more than all the rest of making it (about 10,000 instructions a delivery row of a
-- batch, 8,600 of them the draw). Rows of one statement get consecutive ids and cannot collide;
-- those of two statements could only if both began in the same microsecond and their random
-- numbers fell within their lengths of each other, a chance of about (n1 + n2) / 2^61: 2^-50
-- for two batches of 1,000 deliveries (and a collision fails the publish, it overwrites
-- nothing). The headroom bit leaves 2^61 rows before counting up could reach the variant bits.
-- The time is when the client's statement arrived: calls in one statement share it, which
-- leaves their ids unique but unordered between the calls.

-- The first eight bytes, as a bigint: milliseconds since the epoch (48 bits), version 7, then
-- the millisecond's fraction in 4096ths, of the time the statement began (read twice, and the
-- same both times: a function read once per statement, so inlined rather than called).
CREATE OR REPLACE FUNCTION wq_id_clock()
RETURNS bigint
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT (((date_part('epoch', statement_timestamp()) * 1000000)::bigint / 1000) << 16)
           | 28672  -- version 7
           | ((date_part('epoch', statement_timestamp()) * 1000000)::bigint % 1000 * 4096 / 1000);
$$;

-- The last eight bytes' starting point, as a bigint: the variant (binary 10), a clear bit of
-- headroom, then 61 strong random bits.
CREATE OR REPLACE FUNCTION wq_id_random()
RETURNS bigint
LANGUAGE sql
VOLATILE
PARALLEL SAFE
AS $$
    SELECT (('x' || encode(substring(uuid_send(gen_random_uuid()) FROM 9 FOR 8), 'hex'))
               ::bit(64)::bigint & 2305843009213693951)  -- the low 61 bits
           | (-9223372036854775807 - 1);  -- the top bit: the variant's 1, then its 0 and a 0
$$;

-- The statement's n-th id (n from 1).
CREATE OR REPLACE FUNCTION wq_id_at(p_clock bigint, p_random bigint, p_n bigint)
RETURNS uuid
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT encode(int8send(p_clock) || int8send(p_random + p_n), 'hex')::uuid;
$$;

-- wq_envelope_text_bytes --
-- The UTF-8 size of a message's envelope as jsonb writes it: the length of
-- jsonb_build_object('partition_key', ..., 'attributes', ..., 'payload', ..., 'payload_ref', ...,
-- 'correlation_id', ...)::text, counted from its parts rather than by building that object,
-- which copies the payload and sorts the keys (about 2 us a message, several times the count).
-- The object's text is always its braces, five quoted keys, their ": " and four ", ", 85
-- bytes in all, plus each value's own text ("null" for a missing one): jsonb writes a value
-- inside an object exactly as it writes the value alone. tests/driver/test_envelope_size.py
-- compares the two counts. Plain SQL without SET clauses, so callers inline it.
CREATE OR REPLACE FUNCTION wq_envelope_text_bytes(
    p_partition_key text,
    p_attributes jsonb,
    p_payload jsonb,
    p_payload_ref jsonb,
    p_correlation_id text
)
RETURNS bigint
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT 85::bigint
           + octet_length(COALESCE(to_jsonb(p_partition_key)::text, 'null'))
           + octet_length(COALESCE(p_attributes::text, 'null'))
           + octet_length(COALESCE(p_payload::text, 'null'))
           + octet_length(COALESCE(p_payload_ref::text, 'null'))
           + octet_length(COALESCE(to_jsonb(p_correlation_id)::text, 'null'));
$$;

-- wq_lock_publish_order --
-- Serialise publishes of one (topic, partition key) so that publish ordinals commit in key order.
-- Transaction-scoped; waits at most 5 s, then fails with SQLSTATE 55P03 (retryable).
CREATE OR REPLACE FUNCTION wq_lock_publish_order(p_topic_id uuid, p_partition_key text)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
    SELECT pg_advisory_xact_lock(
        hashtextextended('wq:' || lower(p_topic_id::text) || ':' || p_partition_key, 0)
    );
$$;

-- wq_lock_deduplication_key --
-- Serialise the publishes that reserve one (topic, deduplication key), taken before the
-- reservation: a batch (wq_publish_many) takes its keys' locks in sorted order before it
-- reserves any, so two batches listing shared keys in different orders, or a batch and an
-- enlisted transaction's single publishes, wait for one another instead of deadlocking on
-- the reservations.
-- Transaction-scoped; waits at most 5 s, then fails with SQLSTATE 55P03 (retryable).
CREATE OR REPLACE FUNCTION wq_lock_deduplication_key(p_topic_id uuid, p_deduplication_key text)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
    SELECT pg_advisory_xact_lock(
        hashtextextended('wq-dedup:' || lower(p_topic_id::text) || ':' || p_deduplication_key, 0)
    );
$$;

-- wq_wait_for_topology --
-- Take a topic's topology lock shared, as a publish does, waiting at most 5 s (then SQLSTATE
-- 55P03, which publishers retry): the publish procedures call it only when their first try
-- found the lock held exclusive. A topology change holds it for moments; a session that is no
-- change may hold it as long as it likes (an advisory lock needs no privilege), and every
-- publish to the topic would wait for it with no limit.
CREATE OR REPLACE FUNCTION wq_wait_for_topology(p_topic_id uuid)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
    SELECT pg_advisory_xact_lock_shared(
        hashtextextended('wq-topology:' || lower(p_topic_id::text), 0)
    );
$$;

-- wq_lock_topology --
-- Take the transaction-scoped lock that orders a topic's subscription changes against its
-- publishes: every publish holds it shared while it fans out; a change that depends on the
-- subscription having no deliveries (the partition mode) takes it exclusive, so it waits for
-- publishes in progress and sees their deliveries. Waits at most 5 s (then SQLSTATE 55P03).
CREATE OR REPLACE FUNCTION wq_lock_topology(p_topic_id uuid)
RETURNS TABLE (locked boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('wq-topology:' || lower(p_topic_id::text), 0));
    RETURN QUERY SELECT true;
END;
$$;

-- wq_guard_subscription_delete, wq_guard_topic_delete --
-- Triggers: a subscription that still has deliveries, or a topic that still has messages, cannot
-- be deleted, whatever deletes it (the ORM refuses first, with ProtectedError). The queue tables
-- hold no foreign keys to them: checking one per inserted row cost a sixth of a publish's
-- database time. Each guard takes the topic's topology lock exclusive first, as a partition-mode
-- change does: a publish fanning out to the topic right now commits before the check looks, and
-- one that starts later waits for this transaction and then no longer sees the deleted row.
-- (The deduplication ledger keeps its foreign key to the topic: only keyed publishes write it.)
CREATE OR REPLACE FUNCTION wq_guard_subscription_delete()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM wq_lock_topology(OLD.topic_id);
    IF EXISTS (SELECT 1 FROM workqueue_delivery d WHERE d.subscription_id = OLD.id) THEN
        RAISE EXCEPTION 'subscription % still has deliveries and cannot be deleted', OLD.name
            USING ERRCODE = 'foreign_key_violation',
                  HINT = 'Retire it instead: manage.py workqueue retire-subscription '
                         || OLD.name || ' (add --discard-pending to drop its backlog).';
    END IF;
    RETURN OLD;
END;
$$;

CREATE OR REPLACE FUNCTION wq_guard_topic_delete()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM wq_lock_topology(OLD.id);
    IF EXISTS (SELECT 1 FROM workqueue_message m WHERE m.topic_id = OLD.id) THEN
        RAISE EXCEPTION 'topic % still has messages and cannot be deleted', OLD.name
            USING ERRCODE = 'foreign_key_violation',
                  HINT = 'Retention purges a topic''s messages retention_days after they were '
                         || 'published and their deliveries settled; delete it after that.';
    END IF;
    RETURN OLD;
END;
$$;

-- wq_guard_subscription_mode --
-- Trigger: a subscription's partition mode cannot change once it has deliveries, whatever
-- writes the row (the model's validation refuses first; a role with the topology tables' DML
-- turned an Ordered subscription whose key a dead letter blocks into Exclusive with one UPDATE,
-- and the key's next delivery ran: review helper-173). Takes the topic's topology lock, as the
-- model does, so that deliveries a publish is writing right now are seen. After the row's lock,
-- where the model takes it before: a raw UPDATE racing an admin save of the same subscription's
-- mode can deadlock, and PostgreSQL ends one of them (review helper-174); saves through the
-- model hold the topology lock already, which this call takes again at no cost.
CREATE OR REPLACE FUNCTION wq_guard_subscription_mode()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM wq_lock_topology(OLD.topic_id);
    IF EXISTS (SELECT 1 FROM workqueue_delivery d WHERE d.subscription_id = OLD.id) THEN
        RAISE EXCEPTION 'the partition mode of subscription % cannot change from % to % once it '
                        'has deliveries', OLD.name, OLD.partition_mode, NEW.partition_mode
            USING ERRCODE = 'check_violation',
                  HINT = 'Create a new subscription with the mode instead.';
    END IF;
    RETURN NEW;
END;
$$;

-- wq_guard_ordered_subscription --
-- Trigger: a subscription that becomes one whose keys a publish must lock (Ordered and not
-- Disabled, made so, enabled, refiltered or moved to another topic) takes the topology lock of
-- its topic (of both, in id order, when it moves), whatever writes the row. A publish decides
-- whether to lock its key before it fans out; one that decided without this subscription and
-- then fanned out to it wrote a delivery whose key it never locked, and a later publish of the
-- key committed its ordinal first (review helper-179: a plain UPDATE of status). The model
-- takes these locks before it saves, so they cost its saves nothing; a raw write racing an
-- admin save of the same subscription can deadlock, as wq_guard_subscription_mode can.
CREATE OR REPLACE FUNCTION wq_guard_ordered_subscription()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.topic_id IS DISTINCT FROM NEW.topic_id THEN
        PERFORM wq_lock_topology(LEAST(OLD.topic_id, NEW.topic_id));
        PERFORM wq_lock_topology(GREATEST(OLD.topic_id, NEW.topic_id));
    ELSE
        PERFORM wq_lock_topology(NEW.topic_id);
    END IF;
    RETURN NEW;
END;
$$;

-- Created only when missing, told by name (a guard whose definition changes must take a new
-- name, and drop the old one here): dropping and creating a trigger, or replacing it, locks its
-- table until the migrate commits, against every reader (each claim and publish reads these two
-- tables) or every writer.
DO $delete_guards$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = 'workqueue_subscription'::regclass
                      AND t.tgname = 'wq_subscription_delete_guard') THEN
        CREATE TRIGGER wq_subscription_delete_guard
            BEFORE DELETE ON workqueue_subscription
            FOR EACH ROW EXECUTE FUNCTION wq_guard_subscription_delete();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = 'workqueue_topic'::regclass
                      AND t.tgname = 'wq_topic_delete_guard') THEN
        CREATE TRIGGER wq_topic_delete_guard
            BEFORE DELETE ON workqueue_topic
            FOR EACH ROW EXECUTE FUNCTION wq_guard_topic_delete();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = 'workqueue_subscription'::regclass
                      AND t.tgname = 'wq_subscription_mode_guard') THEN
        CREATE TRIGGER wq_subscription_mode_guard
            BEFORE UPDATE OF partition_mode ON workqueue_subscription
            FOR EACH ROW WHEN (OLD.partition_mode IS DISTINCT FROM NEW.partition_mode)
            EXECUTE FUNCTION wq_guard_subscription_mode();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = 'workqueue_subscription'::regclass
                      AND t.tgname = 'wq_subscription_ordered_insert_guard') THEN
        CREATE TRIGGER wq_subscription_ordered_insert_guard
            BEFORE INSERT ON workqueue_subscription
            FOR EACH ROW WHEN (NEW.partition_mode = 'Ordered' AND NEW.status <> 'Disabled')
            EXECUTE FUNCTION wq_guard_ordered_subscription();
    END IF;
    -- (A change of mode to Ordered is wq_subscription_mode_guard's, which takes the lock too.)
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = 'workqueue_subscription'::regclass
                      AND t.tgname = 'wq_subscription_ordered_update_guard') THEN
        CREATE TRIGGER wq_subscription_ordered_update_guard
            BEFORE UPDATE OF status, filter, topic_id ON workqueue_subscription
            FOR EACH ROW WHEN (NEW.partition_mode = 'Ordered' AND NEW.status <> 'Disabled'
                               AND (OLD.status = 'Disabled'
                                    OR OLD.filter IS DISTINCT FROM NEW.filter
                                    OR OLD.topic_id IS DISTINCT FROM NEW.topic_id))
            EXECUTE FUNCTION wq_guard_ordered_subscription();
    END IF;
END
$delete_guards$;

-- wq_delivery_status, wq_priority, wq_attempt_count --
-- The delivery columns' rules, kept by their types: a domain's constraint is held ready once per
-- session, where PostgreSQL reads a table's CHECK constraints from their stored text and plans
-- them again at every statement that writes the table. Every publish, claim and settle wrote
-- deliveries through statements of their own, and those three CHECKs were a ninth of a
-- publish's database instructions (bench/instructions.py). A value outside its domain is
-- refused as the CHECK refused it, by whatever writes it.
-- Made in three steps so that no row is rewritten: the domain without its constraint, the
-- columns' types (the same base types; the indexes that name the status in their WHERE are
-- rebuilt, a read of the table each, under its lock until the migrate commits), then the
-- constraint NOT VALID: nothing but the CHECKs being replaced ever wrote the rows already there.
-- The constraints spell out pg_catalog's operators, so that no operator a role made in a schema
-- on the migrating session's path is bound into them. A type of one of these names that is not
-- this install's own (a domain over the base type, owned by the tables' owner or a superuser)
-- is refused: its maker could add constraints that run as whoever writes a delivery, or drop
-- the column with it.
DO $delivery_domains$
DECLARE
    v_owner oid := (SELECT c.relowner FROM pg_class c
                     WHERE c.oid = 'workqueue_delivery'::regclass);
    v_changes text[] := ARRAY[]::text[];
    v_domain record;
BEGIN
    IF to_regtype('wq_delivery_status') IS NULL THEN
        CREATE DOMAIN wq_delivery_status AS varchar(20);
        ALTER DOMAIN wq_delivery_status ADD CONSTRAINT wq_delivery_status_valid
            CHECK (VALUE::pg_catalog.text OPERATOR(pg_catalog.=) ANY (
                ARRAY['Pending', 'InFlight', 'Completed', 'DeadLettered', 'Discarded']
                    ::pg_catalog.text[]))
            NOT VALID;
    END IF;
    IF to_regtype('wq_priority') IS NULL THEN
        CREATE DOMAIN wq_priority AS smallint;
        ALTER DOMAIN wq_priority ADD CONSTRAINT wq_priority_range
            CHECK (VALUE OPERATOR(pg_catalog.>=) -100 AND VALUE OPERATOR(pg_catalog.<=) 100)
            NOT VALID;
    END IF;
    IF to_regtype('wq_attempt_count') IS NULL THEN
        CREATE DOMAIN wq_attempt_count AS integer;
        ALTER DOMAIN wq_attempt_count ADD CONSTRAINT wq_attempt_count_nonneg
            CHECK (VALUE OPERATOR(pg_catalog.>=) 0) NOT VALID;
    END IF;
    FOR v_domain IN
        SELECT x.column_name, x.check_name, to_regtype(x.type_name) AS domain_type,
               x.base_type::regtype AS base_type
          FROM (VALUES ('status', 'wq_delivery_status_valid', 'wq_delivery_status',
                        'varchar'),
                       ('priority', 'wq_delivery_priority_range', 'wq_priority', 'int2'),
                       ('attempt_count', 'wq_delivery_attempts_nonneg', 'wq_attempt_count',
                        'int4')) AS x(column_name, check_name, type_name, base_type)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_type t
                        WHERE t.oid = v_domain.domain_type AND t.typtype = 'd'
                          AND t.typbasetype = v_domain.base_type
                          AND (t.typowner = v_owner
                               OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = t.typowner)))
        THEN
            RAISE EXCEPTION 'type % is not the domain this install makes', v_domain.domain_type
                USING HINT = 'Another role made a type of that name in the work queue''s '
                             || 'schema; drop it, then run manage.py migrate again.';
        END IF;
        -- Column by column: one turned back into a plain type (by an AlterField, say) is
        -- given its domain again at the next install.
        IF (SELECT a.atttypid FROM pg_attribute a
             WHERE a.attrelid = 'workqueue_delivery'::regclass
               AND a.attname = v_domain.column_name) <> v_domain.domain_type THEN
            v_changes := v_changes
                || format('DROP CONSTRAINT IF EXISTS %I', v_domain.check_name)
                || format('ALTER COLUMN %I TYPE %s', v_domain.column_name, v_domain.domain_type);
        END IF;
    END LOOP;
    -- In one statement: the indexes are rebuilt once.
    IF cardinality(v_changes) > 0 THEN
        EXECUTE format('ALTER TABLE %s %s', 'workqueue_delivery'::regclass,
                       array_to_string(v_changes, ', '));
    END IF;
END
$delivery_domains$;

-- wq_publish --
-- Publish one message. Returns exactly one row: the message id (for a Duplicate, the id of the
-- message that already owns the deduplication key), the status (Accepted | Duplicate | Rejected)
-- and an error code for rejections. Nothing is written unless the status is Accepted.
-- A topic bound to a transport other than Database (or a 'Database.<variant>') is Rejected with
-- TopicOnOtherTransport (checked right after TopicNotFound): its messages do not live here.
-- The deliveries become due at p_not_before (a past time means now) or p_delay_seconds from
-- now (give one or neither), at most the topic's retention ahead, else InvalidSchedule: a
-- delivery must not outlive the message retention keeps for it. p_priority (-100..100, NULL
-- means 0, else InvalidPriority) orders the due deliveries of a subscription in wq_claim.
-- p_external and p_published_by are the application's word (whether the message came in over
-- the REST API, and as whom): the database sees only the role that holds grant-runtime, which
-- may publish internally anyway, so claiming "not external" gains a caller nothing.
-- The publish wakes the topic's listening hosts with a NOTIFY at commit, unless
-- p_caller_announces is true: the caller then notifies itself once this transaction has
-- committed, a bare pg_notify with nothing to look up: on the channel of announce_topic_id,
-- with announce_payload, the ids of the subscriptions that got a delivery (comma-separated;
-- both NULL when the publish made none). A NOTIFY makes the commit hold a lock that every
-- other notifying transaction in the cluster waits for until this one's commit record is on
-- disk, so publishers that notify cannot share a WAL flush; a caller on its own connection (not
-- enlisted) announces instead.
-- Until 0032 the function returned no announce_ columns; a result shape cannot be replaced in
-- place.
-- Its statements keep one plan per session (plan_cache_mode below). Left to choose, PostgreSQL
-- planned some of them afresh at every call, up to a third of a publish's backend CPU: the
-- Ordered check, whose plan for a call without a partition key folds to a constant, and the
-- fan-out whenever the statistics showed a topic with many subscriptions, since a plan made
-- for one topic's id then looked cheaper than the kept one. Every statement here reads by key
-- (tests/integration/test_query_plans.py), so the kept plan is the same plan.
DO $drop_old_shape$
BEGIN
    IF pg_get_function_result(to_regprocedure(
           'wq_publish(text,uuid,text,jsonb,jsonb,jsonb,text,text,integer,integer,boolean,text,'
           'timestamptz,integer,integer,boolean)'))
       <> 'TABLE(message_id uuid, status text, error_code text, announce_topic_id uuid, '
          'announce_payload text)' THEN
        DROP FUNCTION wq_publish(text, uuid, text, jsonb, jsonb, jsonb, text, text, integer,
                                 integer, boolean, text, timestamptz, integer, integer, boolean);
    END IF;
END
$drop_old_shape$;

CREATE OR REPLACE FUNCTION wq_publish(
    p_topic_name text,
    p_message_id uuid,
    p_partition_key text,
    p_attributes jsonb,
    p_payload jsonb,
    p_payload_ref jsonb,
    p_correlation_id text,
    p_deduplication_key text,
    p_deduplication_ttl_seconds integer,
    p_envelope_bytes integer,
    p_external boolean,
    p_published_by text,
    p_not_before timestamptz,
    p_delay_seconds integer,
    p_priority integer,
    p_caller_announces boolean DEFAULT NULL
)
RETURNS TABLE (message_id uuid, status text, error_code text, announce_topic_id uuid,
               announce_payload text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_topic record;
    v_owner uuid;
    v_owner_status text;
    v_existing record;
    v_ordinal bigint;
    v_attempt integer := 0;
BEGIN
    -- The topic, and the first of the call's problems that reject it, in one statement: as a
    -- PL/pgSQL condition of its own, each check was an expression set up afresh in every
    -- transaction, which is every publish (2 % more of its database instructions). The order is
    -- the rejections' order of precedence.
    SELECT t.id, t.default_deduplication_ttl_seconds,
           CASE
               -- Another transport's messages do not live in these tables: the caller hands the
               -- message to the topic's own transport (see workqueue.publishing). Variants of
               -- the Database transport (driver class 'Database.<variant>') keep theirs here.
               WHEN tr.driver_class <> 'Database' AND tr.driver_class NOT LIKE 'Database.%'
                   THEN 'TopicOnOtherTransport'
               WHEN t.status <> 'Active' OR tr.status <> 'Active' THEN 'TopicDisabled'
               WHEN p_external AND NOT t.allow_external_publish
                   THEN 'TopicNotExternallyPublishable'
               WHEN p_priority < -100 OR p_priority > 100 THEN 'InvalidPriority'
               -- A delay is held to the retention in seconds (as on SQL Server), since its due
               -- time and now() + retention count from two clocks.
               WHEN (p_not_before IS NOT NULL AND p_delay_seconds IS NOT NULL)
                    OR p_delay_seconds < 0
                    OR (CASE WHEN p_delay_seconds > 0
                             THEN p_delay_seconds::bigint > t.retention_days::bigint * 86400
                             ELSE p_not_before > now() + make_interval(days => t.retention_days)
                        END)
                   THEN 'InvalidSchedule'
               -- p_envelope_bytes is the driver's count under the documented rule: the UTF-8
               -- size of the canonical envelope (sorted keys, no spaces). jsonb keeps no text to
               -- count it again, so the count is trusted only where it exceeds the database's
               -- own: the envelope as jsonb writes it, halved, since that text adds at most one
               -- space after each separator. A caller that understates the size (or leaves it
               -- out) stores no envelope over twice the limit.
               WHEN GREATEST(p_envelope_bytes, wq_envelope_text_bytes(
                        p_partition_key, p_attributes, p_payload, p_payload_ref,
                        p_correlation_id) / 2)
                    > LEAST(t.max_payload_bytes, 262144)
                   THEN 'PayloadTooLarge'
           END AS rejection
      INTO v_topic
      FROM workqueue_topic t
      JOIN workqueue_transport tr ON tr.id = t.transport_id
     WHERE t.name = lower(btrim(p_topic_name));
    IF NOT FOUND OR v_topic.rejection IS NOT NULL THEN
        RETURN QUERY SELECT p_message_id, 'Rejected'::text,
                            COALESCE(v_topic.rejection, 'TopicNotFound'), NULL::uuid, NULL::text;
        RETURN;
    END IF;

    -- Held until commit, so a partition-mode change waits for this fan-out (wq_lock_topology).
    IF NOT pg_try_advisory_xact_lock_shared(
            hashtextextended('wq-topology:' || lower(v_topic.id::text), 0)) THEN
        PERFORM wq_wait_for_topology(v_topic.id);
        -- A topology change held the lock, a move of the topic to another transport perhaps,
        -- committed by now: read before it, the topic's transport is read again (since 0048),
        -- or this fan-out wrote deliveries no host would read any more.
        IF NOT EXISTS (
                SELECT 1 FROM workqueue_topic t JOIN workqueue_transport tr ON tr.id = t.transport_id
                 WHERE t.id = v_topic.id
                   AND (tr.driver_class = 'Database' OR tr.driver_class LIKE 'Database.%')) THEN
            RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'TopicOnOtherTransport',
                                NULL::uuid, NULL::text;
            RETURN;
        END IF;
    END IF;

    -- Ordered subscriptions need a key's ordinals to commit in publish order. The key is
    -- tested on its own first: a condition holding a subquery is a statement for the executor
    -- to start and end at every call, even when the key is missing and it reads nothing.
    IF p_partition_key IS NOT NULL THEN
        -- A key the column would store as another (over 200 characters, the rest spaces, is
        -- cut to 200 without an error) would take another key's order lock: refused, as the
        -- application refuses it (review helper-179). Here, not with the checks above: there
        -- every keyless publish paid for it (0.9 % of its instructions).
        IF p_partition_key = '' OR p_partition_key LIKE '% ' OR length(p_partition_key) > 200 THEN
            RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'InvalidPartitionKey'::text,
                                NULL::uuid, NULL::text;
            RETURN;
        END IF;
        IF EXISTS (
            SELECT 1 FROM workqueue_subscription s
             WHERE s.topic_id = v_topic.id AND s.partition_mode = 'Ordered'
               AND s.status <> 'Disabled'
               AND (s.filter IS NULL OR wq_filter_matches(s.filter, p_attributes))
        ) THEN
            PERFORM wq_lock_publish_order(v_topic.id, p_partition_key);
        END IF;
    END IF;

    IF p_deduplication_key IS NOT NULL THEN
        -- The window's bounds are the application's (60 s to 30 days): a shorter or negative
        -- one would switch the key's deduplication off, a longer one hold the key for decades.
        -- Tested here, where a key is given, so that a publish without one pays nothing.
        -- So is a key the column would store as another (over 200 characters, the rest
        -- spaces, is cut to 200 without an error): this call's later statements compare the
        -- key as given, so its reservation would never be confirmed and a duplicate would be
        -- accepted once it lapsed (review helper-193). The application never sends one.
        IF p_deduplication_ttl_seconds NOT BETWEEN 60 AND 2592000
           OR p_deduplication_key = '' OR p_deduplication_key LIKE '% '
           OR length(p_deduplication_key) > 200 THEN
            RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'InvalidDeduplication'::text,
                                NULL::uuid, NULL::text;
            RETURN;
        END IF;
        PERFORM wq_lock_deduplication_key(v_topic.id, p_deduplication_key);
        LOOP
            v_attempt := v_attempt + 1;
            -- Take the key when free, when its window has passed, or when this same message
            -- reserved it before (a retry after a crash). Never take a confirmed key.
            INSERT INTO workqueue_deduplication AS d
                   (id, topic_id, deduplication_key, message_id, status, expires_at)
            VALUES (wq_new_id(), v_topic.id, p_deduplication_key, p_message_id,
                    'Reserved', statement_timestamp() + interval '120 seconds')
            ON CONFLICT ON CONSTRAINT wq_dedup_topic_key_uq DO UPDATE
               SET message_id = EXCLUDED.message_id, status = 'Reserved',
                   expires_at = EXCLUDED.expires_at
             WHERE d.expires_at <= statement_timestamp()
                OR (d.status = 'Reserved' AND d.message_id = EXCLUDED.message_id)
            RETURNING d.message_id INTO v_owner;
            EXIT WHEN v_owner IS NOT NULL;

            SELECT d.message_id, d.status INTO v_owner, v_owner_status
              FROM workqueue_deduplication d
             WHERE d.topic_id = v_topic.id AND d.deduplication_key = p_deduplication_key
               AND d.expires_at > statement_timestamp();
            IF FOUND AND v_owner_status = 'Confirmed' THEN
                RETURN QUERY SELECT v_owner, 'Duplicate'::text, NULL::text, NULL::uuid, NULL::text;
                RETURN;
            ELSIF FOUND THEN
                RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'DeduplicationPending'::text,
                                    NULL::uuid, NULL::text;
                RETURN;
            ELSIF v_attempt >= 3 THEN
                RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'TransportUnavailable'::text,
                                    NULL::uuid, NULL::text;
                RETURN;
            END IF;
            -- The owner vanished between the two statements: try to take the key again.
        END LOOP;
    END IF;

    INSERT INTO workqueue_message
           (id, publish_ordinal, topic_id, partition_key, attributes, payload, payload_ref,
            correlation_id, published_at, published_by, published_externally)
    VALUES (p_message_id, nextval('wq_publish_ordinal_seq'), v_topic.id, p_partition_key,
            p_attributes, p_payload, p_payload_ref, p_correlation_id, now(), p_published_by,
            coalesce(p_external, false))
    ON CONFLICT (id) DO NOTHING
    RETURNING publish_ordinal INTO v_ordinal;

    IF NOT FOUND THEN
        -- The id is taken. Undo this call's own reservation; nobody else can see it yet.
        IF p_deduplication_key IS NOT NULL THEN
            DELETE FROM workqueue_deduplication d
             WHERE d.topic_id = v_topic.id AND d.deduplication_key = p_deduplication_key
               AND d.message_id = p_message_id AND d.status = 'Reserved';
        END IF;
        SELECT m.topic_id, m.partition_key, m.attributes, m.payload, m.payload_ref,
               m.correlation_id
          INTO v_existing
          FROM workqueue_message m WHERE m.id = p_message_id;
        IF NOT FOUND THEN
            -- Purged between the insert and this read; the caller may retry.
            RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'TransportUnavailable'::text,
                                NULL::uuid, NULL::text;
        ELSIF v_existing.topic_id = v_topic.id
          AND v_existing.partition_key IS NOT DISTINCT FROM p_partition_key
          AND v_existing.attributes IS NOT DISTINCT FROM p_attributes
          AND v_existing.payload IS NOT DISTINCT FROM p_payload
          AND v_existing.payload_ref IS NOT DISTINCT FROM p_payload_ref
          AND v_existing.correlation_id IS NOT DISTINCT FROM p_correlation_id THEN
            RETURN QUERY SELECT p_message_id, 'Duplicate'::text, NULL::text, NULL::uuid, NULL::text;
        ELSE
            RETURN QUERY SELECT p_message_id, 'Rejected'::text, 'MessageIDConflict'::text,
                                NULL::uuid, NULL::text;
        END IF;
        RETURN;
    END IF;

    -- The result row is this statement's: the subscriptions that got a delivery, for the
    -- announcement (both announce_ columns NULL when it made none).
    WITH fanned AS (
        INSERT INTO workqueue_delivery
               (id, message_id, subscription_id, status, partition_key, order_key,
                attempt_count, is_replay, visible_at, priority)
        SELECT wq_new_id(), p_message_id, s.id, 'Pending',
               CASE WHEN s.partition_mode <> 'None' THEN p_partition_key END,
               v_ordinal, 0, false,
               -- A delay runs from the call (statement_timestamp()), not from the
               -- transaction's start: enlisted late in a long transaction, it would be over,
               -- or nearly, at the commit. No delay is due now(), the claims' clock, so a
               -- transaction sees its own publish due.
               CASE WHEN p_delay_seconds > 0
                    THEN statement_timestamp() + make_interval(secs => p_delay_seconds)
                    ELSE GREATEST(COALESCE(p_not_before, now()), now()) END,
               COALESCE(p_priority, 0)
          FROM workqueue_subscription s
         WHERE s.topic_id = v_topic.id AND s.status <> 'Disabled'
           -- Most subscriptions have no filter: they skip the call (a PL/pgSQL call per
           -- delivery is a good part of what a fan-out row costs; wq_filter_matches(NULL, ...)
           -- is true).
           AND (s.filter IS NULL OR wq_filter_matches(s.filter, p_attributes))
        RETURNING subscription_id
    )
    SELECT p_message_id, 'Accepted', NULL, CASE WHEN count(*) > 0 THEN v_topic.id END,
           string_agg(f.subscription_id::text, ',')
      INTO message_id, status, error_code, announce_topic_id, announce_payload
      FROM fanned f;

    IF p_deduplication_key IS NOT NULL THEN
        UPDATE workqueue_deduplication d
           SET status = 'Confirmed',
               expires_at = statement_timestamp() + make_interval(secs => COALESCE(
                   p_deduplication_ttl_seconds, v_topic.default_deduplication_ttl_seconds))
         WHERE d.topic_id = v_topic.id AND d.deduplication_key = p_deduplication_key
           AND d.message_id = p_message_id;
    END IF;

    IF p_caller_announces IS NOT TRUE AND announce_topic_id IS NOT NULL THEN
        -- Delivered at commit only, so a rolled-back enlisted publish wakes nobody.
        PERFORM pg_notify(wq_topic_channel(v_topic.id), '');
        announce_topic_id := NULL;
        announce_payload := NULL;
    END IF;
    RETURN NEXT;
END;
$$;

-- wq_topic_channel --
-- The LISTEN/NOTIFY channel on which publishes to a topic are announced.
CREATE OR REPLACE FUNCTION wq_topic_channel(p_topic_id uuid)
RETURNS text
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT 'wq_' || replace(lower(p_topic_id::text), '-', '');
$$;

-- wq_announce --
-- Wake the hosts listening for a topic's publishes, for a caller whose publish (with
-- p_caller_announces) has committed and who does not read the publish's announce_ columns:
-- processes of releases before 0032 during an upgrade (this release notifies on those columns
-- itself, with nothing to look up). A transaction that writes nothing but its notification
-- writes no WAL before its commit record, so PostgreSQL commits it without waiting for a flush:
-- the lock a NOTIFY holds through commit is held for microseconds. (The announcement is only a
-- hint, lost with the server like any notification; hosts still poll.) An unknown topic
-- announces nothing.
-- With p_message_ids (a JSON array of the published ids) on a topic where a filter keeps some
-- subscription from some messages, the notification's payload names the subscriptions that got
-- deliveries (their ids, comma-separated), so that hosts wake only those consumers; when none
-- did, nothing is announced. An empty payload wakes every consumer of the topic: without ids,
-- without filters, or when the list would not fit a notification.
CREATE OR REPLACE FUNCTION wq_announce(p_topic_name text, p_message_ids jsonb DEFAULT NULL)
RETURNS TABLE (announced boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_topic_id uuid;
    v_subscriptions text := '';
BEGIN
    SELECT t.id INTO v_topic_id FROM workqueue_topic t WHERE t.name = lower(btrim(p_topic_name));
    IF NOT FOUND THEN
        RETURN QUERY SELECT false;
        RETURN;
    END IF;
    IF jsonb_typeof(p_message_ids) = 'array' AND EXISTS (
        SELECT 1 FROM workqueue_subscription s
         WHERE s.topic_id = v_topic_id AND s.status <> 'Disabled'
           AND s.filter IS NOT NULL AND jsonb_typeof(s.filter) <> 'null'
    ) THEN
        SELECT coalesce(string_agg(DISTINCT d.subscription_id::text, ','), '')
          INTO v_subscriptions
          FROM jsonb_array_elements_text(p_message_ids) AS m(id)
          JOIN workqueue_delivery d ON d.message_id = m.id::uuid;
        IF v_subscriptions = '' THEN
            RETURN QUERY SELECT false;
            RETURN;
        END IF;
        IF octet_length(v_subscriptions) > 7000 THEN
            v_subscriptions := '';  -- a notification's payload holds under 8000 bytes
        END IF;
    END IF;
    PERFORM pg_notify(wq_topic_channel(v_topic_id), v_subscriptions);
    RETURN QUERY SELECT true;
END;
$$;

-- wq_publish_items --
-- The items of a wq_publish_many batch as rows, each with its zero-based position, its due time
-- and the code wq_publish would reject it with for its own fields (NULL when it passes): the
-- same checks, in the same order, against the topic's max_payload_bytes and retention_days.
-- Unsorted: the caller orders by item_index wherever order matters, and a sort here would copy
-- every payload once more.
CREATE OR REPLACE FUNCTION wq_publish_items(
    p_messages jsonb,
    p_max_payload_bytes integer,
    p_retention_days integer
)
RETURNS TABLE (item_index integer, message_id uuid, partition_key text, attributes jsonb,
               payload jsonb, payload_ref jsonb, correlation_id text, due_at timestamptz,
               priority integer, error_code text)
LANGUAGE sql
STABLE
AS $$
    SELECT i.idx, i.id, i.partition_key, i.attributes, i.payload, i.payload_ref,
           i.correlation_id, i.due,
           i.priority,
           CASE
               -- As in wq_publish: a key stored as another would lock apart from it. (Tested
               -- for NULL first: a keyless item then evaluates one test, not three.)
               WHEN i.partition_key IS NOT NULL
                    AND (i.partition_key = '' OR i.partition_key LIKE '% '
                         OR length(i.partition_key) > 200)
                   THEN 'InvalidPartitionKey'
               WHEN i.priority IS NOT NULL AND (i.priority < -100 OR i.priority > 100)
                   THEN 'InvalidPriority'
               WHEN (i.not_before IS NOT NULL AND i.delay_seconds IS NOT NULL)
                    OR i.delay_seconds < 0
                    OR (i.due > now() AND CASE
                            WHEN i.delay_seconds > 0
                                THEN i.delay_seconds::bigint > p_retention_days::bigint * 86400
                            ELSE i.due > now() + make_interval(days => p_retention_days) END)
                   THEN 'InvalidSchedule'
               WHEN GREATEST(i.envelope_bytes, wq_envelope_text_bytes(
                        i.partition_key, i.attributes, i.payload, i.payload_ref,
                        i.correlation_id) / 2)
                    > LEAST(p_max_payload_bytes, 262144)
                   THEN 'PayloadTooLarge'
           END
      FROM (
        SELECT f.*,
               -- Most messages are due at once: no interval to make or compare.
               -- A delay runs from the call, as in wq_publish; none is due now().
               CASE WHEN f.not_before IS NULL AND f.delay_seconds IS NULL THEN now()
                    WHEN f.delay_seconds > 0
                         THEN statement_timestamp() + make_interval(secs => f.delay_seconds)
                    ELSE GREATEST(COALESCE(f.not_before, now()), now())
               END AS due
          FROM (
            SELECT (e.ordinality - 1)::integer AS idx,
                   (e.value ->> 'message_id')::uuid AS id,
                   e.value ->> 'partition_key' AS partition_key,
                   NULLIF(e.value -> 'attributes', 'null'::jsonb) AS attributes,
                   NULLIF(e.value -> 'payload', 'null'::jsonb) AS payload,
                   NULLIF(e.value -> 'payload_ref', 'null'::jsonb) AS payload_ref,
                   e.value ->> 'correlation_id' AS correlation_id,
                   (e.value ->> 'envelope_bytes')::integer AS envelope_bytes,
                   (e.value ->> 'not_before')::timestamptz AS not_before,
                   (e.value ->> 'delay_seconds')::integer AS delay_seconds,
                   (e.value ->> 'priority')::integer AS priority
              FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ordinality)
          ) f
      ) i;
$$;

-- wq_publish_many --
-- Publish a JSON array of messages to one topic in one transaction, in array order. The
-- ordered-publish locks of every partition key in the batch are taken first, then those of its
-- deduplication keys, each in sorted order, so two batches sharing keys cannot deadlock. Returns
-- one row per item with its zero-based position, with the result wq_publish would give it.
-- The topic is read once per batch and a batch without deduplication keys is written with one
-- INSERT of its messages and one of their deliveries; ordinals follow array order. A batch with
-- a deduplication key runs wq_publish item by item (the key's reserve-then-confirm protocol).
-- p_caller_announces as for wq_publish: one NOTIFY covers the batch, or the first row's
-- announce_topic_id and announce_payload (the subscriptions that got any of its deliveries)
-- do; in a batch run item by item, each accepted item's row carries its own.
-- Its statements keep one plan per session, as wq_publish's do and for the same reasons; the
-- batch statement is written to stay cheap on a plan made while the tables were small (below).
-- Until 0032 the function returned no announce_ columns; a result shape cannot be replaced in
-- place.
DO $drop_old_shape$
BEGIN
    IF pg_get_function_result(to_regprocedure('wq_publish_many(text,jsonb,boolean,text,boolean)'))
       <> 'TABLE(item_index integer, message_id uuid, status text, error_code text, '
          'announce_topic_id uuid, announce_payload text)' THEN
        DROP FUNCTION wq_publish_many(text, jsonb, boolean, text, boolean);
    END IF;
END
$drop_old_shape$;

CREATE OR REPLACE FUNCTION wq_publish_many(
    p_topic_name text,
    p_messages jsonb,
    p_external boolean,
    p_published_by text,
    p_caller_announces boolean DEFAULT NULL
)
RETURNS TABLE (item_index integer, message_id uuid, status text, error_code text,
               announce_topic_id uuid, announce_payload text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_topic record;
    v_topic_error text;
    v_key text;
    v_item record;
    v_ordinals bigint[];
    v_ids uuid[];
    v_accepted boolean[];
    v_codes text[];
    v_subscriptions text;
    v_announce_topic_id uuid;
    v_id_clock bigint;
    v_id_random bigint;
BEGIN
    SELECT t.id, t.status AS topic_status, tr.status AS transport_status, tr.driver_class,
           t.allow_external_publish, t.max_payload_bytes, t.retention_days
      INTO v_topic
      FROM workqueue_topic t
      JOIN workqueue_transport tr ON tr.id = t.transport_id
     WHERE t.name = lower(btrim(p_topic_name));
    IF NOT FOUND THEN
        v_topic_error := 'TopicNotFound';
    ELSIF v_topic.driver_class <> 'Database' AND v_topic.driver_class NOT LIKE 'Database.%' THEN
        v_topic_error := 'TopicOnOtherTransport';
    ELSIF v_topic.topic_status <> 'Active' OR v_topic.transport_status <> 'Active' THEN
        v_topic_error := 'TopicDisabled';
    ELSIF p_external AND NOT v_topic.allow_external_publish THEN
        v_topic_error := 'TopicNotExternallyPublishable';
    END IF;
    IF v_topic_error IS NOT NULL THEN
        -- A topic problem outranks every item's own, as in wq_publish.
        RETURN QUERY
        SELECT (e.ordinality - 1)::integer, (e.value ->> 'message_id')::uuid, 'Rejected'::text,
               v_topic_error, NULL::uuid, NULL::text
          FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ordinality)
         ORDER BY e.ordinality;
        RETURN;
    END IF;

    -- Held until commit, so a partition-mode change waits for this fan-out (wq_lock_topology).
    -- Taken before the Ordered check: a change to Ordered that commits after the check and
    -- before the fan-out would otherwise get deliveries whose key was never locked, and a later
    -- publish of that key could commit its ordinal first.
    IF NOT pg_try_advisory_xact_lock_shared(
            hashtextextended('wq-topology:' || lower(v_topic.id::text), 0)) THEN
        PERFORM wq_wait_for_topology(v_topic.id);
        -- Read again once a topology change let go of the lock, as in wq_publish.
        IF NOT EXISTS (
                SELECT 1 FROM workqueue_topic t JOIN workqueue_transport tr ON tr.id = t.transport_id
                 WHERE t.id = v_topic.id
                   AND (tr.driver_class = 'Database' OR tr.driver_class LIKE 'Database.%')) THEN
            RETURN QUERY
            SELECT (e.ordinality - 1)::integer, (e.value ->> 'message_id')::uuid,
                   'Rejected'::text, 'TopicOnOtherTransport'::text, NULL::uuid, NULL::text
              FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ordinality)
             ORDER BY e.ordinality;
            RETURN;
        END IF;
    END IF;

    IF EXISTS (
        SELECT 1 FROM workqueue_subscription s
         WHERE s.topic_id = v_topic.id AND s.partition_mode = 'Ordered' AND s.status <> 'Disabled'
    ) THEN
        FOR v_key IN
            SELECT DISTINCT e ->> 'partition_key' COLLATE "C" AS k
              FROM jsonb_array_elements(p_messages) e
             WHERE e ->> 'partition_key' IS NOT NULL
             ORDER BY 1
        LOOP
            PERFORM wq_lock_publish_order(v_topic.id, v_key);
        END LOOP;
    END IF;

    IF EXISTS (SELECT 1 FROM jsonb_array_elements(p_messages) e
                WHERE e ->> 'deduplication_key' IS NOT NULL) THEN
        -- Until 0044 the keys were reserved in array order only: batches sharing keys in other
        -- orders deadlocked, were retried whole and at last Rejected.
        FOR v_key IN
            SELECT DISTINCT e ->> 'deduplication_key' COLLATE "C" AS k
              FROM jsonb_array_elements(p_messages) e
             WHERE e ->> 'deduplication_key' IS NOT NULL
             ORDER BY 1
        LOOP
            PERFORM wq_lock_deduplication_key(v_topic.id, v_key);
        END LOOP;
        FOR v_item IN
            SELECT (e.ordinality - 1)::integer AS idx, e.value AS m
              FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ordinality)
             ORDER BY e.ordinality
        LOOP
            RETURN QUERY
            SELECT v_item.idx, r.message_id, r.status, r.error_code, r.announce_topic_id,
                   r.announce_payload
              FROM wq_publish(
                    p_topic_name,
                    (v_item.m ->> 'message_id')::uuid,
                    v_item.m ->> 'partition_key',
                    NULLIF(v_item.m -> 'attributes', 'null'::jsonb),
                    NULLIF(v_item.m -> 'payload', 'null'::jsonb),
                    NULLIF(v_item.m -> 'payload_ref', 'null'::jsonb),
                    v_item.m ->> 'correlation_id',
                    v_item.m ->> 'deduplication_key',
                    (v_item.m ->> 'deduplication_ttl_seconds')::integer,
                    (v_item.m ->> 'envelope_bytes')::integer,
                    p_external,
                    p_published_by,
                    (v_item.m ->> 'not_before')::timestamptz,
                    (v_item.m ->> 'delay_seconds')::integer,
                    (v_item.m ->> 'priority')::integer,
                    p_caller_announces) AS r;
        END LOOP;
        RETURN;
    END IF;

    -- One ordinal per item, taken in one go and handed out in array order (sorted, so the
    -- order does not depend on how the set was evaluated); a rejected item leaves a gap.
    v_ordinals := ARRAY(
        SELECT o FROM (
            SELECT nextval('wq_publish_ordinal_seq') AS o
              FROM generate_series(1, jsonb_array_length(p_messages))
        ) n ORDER BY o);
    -- The deliveries' ids: consecutive from one random start (wq_id_at).
    v_id_clock := wq_id_clock();
    v_id_random := wq_id_random();

    WITH checked AS (
        SELECT i.*, v_ordinals[i.item_index + 1] AS ordinal
          FROM wq_publish_items(p_messages, v_topic.max_payload_bytes, v_topic.retention_days) i
    ), items AS (
        SELECT c.* FROM checked c WHERE c.error_code IS NULL
    ), inserted AS (
        -- An id already taken (before, or by an earlier item of this batch) inserts nothing;
        -- the result query below tells a duplicate from a conflict.
        INSERT INTO workqueue_message
               (id, publish_ordinal, topic_id, partition_key, attributes, payload, payload_ref,
                correlation_id, published_at, published_by, published_externally)
        SELECT i.message_id, i.ordinal, v_topic.id, i.partition_key, i.attributes, i.payload,
               i.payload_ref, i.correlation_id, now(), p_published_by, coalesce(p_external, false)
          FROM items i
         ORDER BY i.item_index
        ON CONFLICT (id) DO NOTHING
        RETURNING publish_ordinal
    ), settled AS (
        -- Whether each item's row went in. A membership test in the select list is one hashed
        -- set of the inserted ordinals; as a join condition (IN in WHERE, or = ANY of their
        -- array) the planner, sure from a CTE's estimates that one row is in play, compared
        -- every item with every ordinal (a batch of 5,000: a second, 12.5 million comparisons).
        -- Only what the fan-out and the results read: the payloads stay in checked.
        SELECT c.item_index, c.message_id, c.partition_key, c.attributes, c.ordinal, c.due_at,
               c.priority, c.error_code,
               c.ordinal IN (SELECT x.publish_ordinal FROM inserted x) AS accepted
          FROM checked c
    ), fanned AS (
        INSERT INTO workqueue_delivery
               (id, message_id, subscription_id, status, partition_key, order_key,
                attempt_count, is_replay, visible_at, priority)
        -- Numbered in the order inserted, so each id lands at the index's right-hand edge.
        SELECT wq_id_at(v_id_clock, v_id_random, row_number() OVER (ORDER BY i.item_index)),
               i.message_id, s.id, 'Pending',
               CASE WHEN s.partition_mode <> 'None' THEN i.partition_key END,
               i.ordinal, 0, false, i.due_at, COALESCE(i.priority, 0)
          FROM settled i
          JOIN workqueue_subscription s
            ON s.topic_id = v_topic.id AND s.status <> 'Disabled'
           AND (s.filter IS NULL OR wq_filter_matches(s.filter, i.attributes))
         WHERE i.accepted
         ORDER BY i.item_index
        RETURNING subscription_id
    )
    SELECT ARRAY(SELECT c.message_id FROM settled c ORDER BY c.item_index),
           ARRAY(SELECT c.error_code FROM settled c ORDER BY c.item_index),
           ARRAY(SELECT c.accepted FROM settled c ORDER BY c.item_index),
           -- Each subscription that got a delivery, once (NULL: none did): made distinct as
           -- uuids, and only those few written out as text (a DISTINCT on the text sorted a
           -- text per delivery).
           (SELECT string_agg(d.id::text, ',')
              FROM (SELECT DISTINCT f.subscription_id AS id FROM fanned f) d)
      INTO v_ids, v_codes, v_accepted, v_subscriptions;

    IF v_subscriptions IS NOT NULL AND p_caller_announces IS NOT TRUE THEN
        -- Delivered at commit only, so a rolled-back enlisted publish wakes nobody.
        PERFORM pg_notify(wq_topic_channel(v_topic.id), '');
    ELSIF v_subscriptions IS NOT NULL THEN
        v_announce_topic_id := v_topic.id;
    END IF;

    IF true = ALL (v_accepted) THEN
        -- The usual batch, every item stored: Accepted throughout, nothing to look up.
        RETURN QUERY
        SELECT (u.ordinality - 1)::integer, u.id, 'Accepted'::text, NULL::text,
               CASE WHEN u.ordinality = 1 THEN v_announce_topic_id END,
               CASE WHEN u.ordinality = 1 AND v_announce_topic_id IS NOT NULL
                    THEN v_subscriptions END
          FROM unnest(v_ids) WITH ORDINALITY AS u(id, ordinality)
         ORDER BY u.ordinality;
        RETURN;
    END IF;

    -- Each item's result: its own rejection, Accepted when its row went in, else the id was
    -- taken and the stored message decides between Duplicate and MessageIDConflict (NULL: it
    -- was purged between the insert and this read, and the caller may retry). Only such an item
    -- reads the table, one index probe each, inside a CASE so that the others read nothing (and
    -- only such an item is read out of p_messages again, by position). A join would let a plan
    -- cached while the table was small hash the whole table on every batch after it has grown
    -- (seen: 14,000 -> 6,000 messages/s within a 60,000-message run).
    RETURN QUERY
    SELECT r.idx, r.id,
           CASE WHEN r.code IS NOT NULL THEN 'Rejected'
                WHEN r.accepted THEN 'Accepted'
                WHEN r.stored = 'Duplicate' THEN 'Duplicate'
                ELSE 'Rejected' END,
           CASE WHEN r.code IS NOT NULL THEN r.code
                WHEN r.accepted OR r.stored = 'Duplicate' THEN NULL
                ELSE COALESCE(r.stored, 'TransportUnavailable') END,
           CASE WHEN r.idx = 0 THEN v_announce_topic_id END,
           CASE WHEN r.idx = 0 AND v_announce_topic_id IS NOT NULL THEN v_subscriptions END
      FROM (
        SELECT x.idx, x.id, x.code, x.accepted,
               CASE WHEN x.code IS NULL AND NOT x.accepted THEN (
                   SELECT CASE
                              WHEN m.topic_id = v_topic.id
                               AND m.partition_key IS NOT DISTINCT FROM i.value ->> 'partition_key'
                               AND m.attributes IS NOT DISTINCT FROM
                                   NULLIF(i.value -> 'attributes', 'null')
                               AND m.payload IS NOT DISTINCT FROM
                                   NULLIF(i.value -> 'payload', 'null')
                               AND m.payload_ref IS NOT DISTINCT FROM
                                   NULLIF(i.value -> 'payload_ref', 'null')
                               AND m.correlation_id IS NOT DISTINCT FROM
                                   i.value ->> 'correlation_id'
                                  THEN 'Duplicate'
                              ELSE 'MessageIDConflict'
                          END
                     FROM workqueue_message m
                    CROSS JOIN LATERAL (SELECT p_messages -> x.idx AS value) i
                    WHERE m.id = x.id)
               END AS stored
          FROM (
            -- The items' ids, codes and acceptance as the batch statement collected them, in
            -- array order: p_messages is not taken apart a second time.
            SELECT (u.ordinality - 1)::integer AS idx, u.id, u.code, u.accepted
              FROM unnest(v_ids, v_codes, v_accepted)
                   WITH ORDINALITY AS u(id, code, accepted, ordinality)
          ) x
        -- Not merged into the query above (OFFSET 0), where each use of r.stored would run its
        -- lookup again: one probe per item of a batch retried whole.
        OFFSET 0
      ) r
     ORDER BY r.idx;
END;
$$;

-- wq_reserve_deduplication --
-- Reserve a topic's deduplication key for a message a transport outside these tables is about
-- to send (the AWS transport): the first step of reserve, send, confirm (or release). Returns
-- one row: status Reserved (this message holds the key for 120 s), Duplicate (a confirmed
-- owner holds it; owner_message_id names it, this message's own id when it was confirmed
-- before), Pending (another message's live reservation holds it: publish again shortly) or
-- TopicNotFound. The key is taken as wq_publish takes it: when free, when its window has
-- passed, or when this same message reserved it before (a retry after a crash).
CREATE OR REPLACE FUNCTION wq_reserve_deduplication(
    p_topic_name text,
    p_deduplication_key text,
    p_message_id uuid
)
RETURNS TABLE (status text, owner_message_id uuid)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_topic_id uuid;
    v_owner uuid;
    v_owner_status text;
    v_attempt integer := 0;
BEGIN
    -- A key the column would store as another could never be confirmed (wq_publish).
    IF p_deduplication_key = '' OR p_deduplication_key LIKE '% '
       OR length(p_deduplication_key) > 200 THEN
        RAISE EXCEPTION 'wq_reserve_deduplication: the deduplication key is empty, ends with a '
                        'space or is longer than 200 characters'
              USING ERRCODE = '22023';
    END IF;
    SELECT t.id INTO v_topic_id
      FROM workqueue_topic t WHERE t.name = lower(btrim(p_topic_name));
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'TopicNotFound'::text, NULL::uuid;
        RETURN;
    END IF;
    LOOP
        v_attempt := v_attempt + 1;
        INSERT INTO workqueue_deduplication AS d
               (id, topic_id, deduplication_key, message_id, status, expires_at)
        VALUES (wq_new_id(), v_topic_id, p_deduplication_key, p_message_id,
                'Reserved', statement_timestamp() + interval '120 seconds')
        ON CONFLICT ON CONSTRAINT wq_dedup_topic_key_uq DO UPDATE
           SET message_id = EXCLUDED.message_id, status = 'Reserved',
               expires_at = EXCLUDED.expires_at
         WHERE d.expires_at <= statement_timestamp()
            OR (d.status = 'Reserved' AND d.message_id = EXCLUDED.message_id)
        RETURNING d.message_id INTO v_owner;
        IF v_owner IS NOT NULL THEN
            RETURN QUERY SELECT 'Reserved'::text, v_owner;
            RETURN;
        END IF;
        SELECT d.message_id, d.status INTO v_owner, v_owner_status
          FROM workqueue_deduplication d
         WHERE d.topic_id = v_topic_id AND d.deduplication_key = p_deduplication_key
           AND d.expires_at > statement_timestamp();
        IF FOUND AND v_owner_status = 'Confirmed' THEN
            RETURN QUERY SELECT 'Duplicate'::text, v_owner;
            RETURN;
        ELSIF FOUND THEN
            RETURN QUERY SELECT 'Pending'::text, v_owner;
            RETURN;
        ELSIF v_attempt >= 3 THEN
            RETURN QUERY SELECT 'Pending'::text, NULL::uuid;
            RETURN;
        END IF;
        -- The owner vanished between the two statements: try to take the key again.
    END LOOP;
END;
$$;

-- wq_confirm_deduplication --
-- The message that reserved a deduplication key was sent: hold the key for
-- p_deduplication_ttl_seconds (NULL: the topic's default; else at least 60 s; a message id's
-- own entry is held for the topic's retention, which may pass 30 days) from now. Affects one
-- row, or none when the reservation is no longer this message's (it lapsed and another
-- publish took it) or the window is under a minute. Only a reservation is confirmed:
-- a confirmed key keeps the window it was given, or any caller that knows its message id
-- could shorten it (and let the message be published, and delivered, again).
CREATE OR REPLACE FUNCTION wq_confirm_deduplication(
    p_topic_name text,
    p_deduplication_key text,
    p_message_id uuid,
    p_deduplication_ttl_seconds integer
)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_count integer;
BEGIN
    UPDATE workqueue_deduplication d
       SET status = 'Confirmed',
           expires_at = statement_timestamp() + make_interval(
               secs => COALESCE(p_deduplication_ttl_seconds, t.default_deduplication_ttl_seconds))
      FROM workqueue_topic t
     WHERE t.name = lower(btrim(p_topic_name)) AND d.topic_id = t.id
       AND d.deduplication_key = p_deduplication_key AND d.message_id = p_message_id
       AND d.status = 'Reserved'
       AND (p_deduplication_ttl_seconds IS NULL OR p_deduplication_ttl_seconds >= 60);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN QUERY SELECT v_count;
END;
$$;

-- wq_release_deduplication --
-- Sending the message that reserved a deduplication key failed: free the key at once, so a
-- retry need not wait out the reservation. Only this message's reservation is removed (never a
-- confirmed key); affects one row or none.
CREATE OR REPLACE FUNCTION wq_release_deduplication(
    p_topic_name text,
    p_deduplication_key text,
    p_message_id uuid
)
RETURNS TABLE (affected_rows integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workqueue_deduplication d
     USING workqueue_topic t
     WHERE t.name = lower(btrim(p_topic_name)) AND d.topic_id = t.id
       AND d.deduplication_key = p_deduplication_key AND d.message_id = p_message_id
       AND d.status = 'Reserved';
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN QUERY SELECT v_count;
END;
$$;
