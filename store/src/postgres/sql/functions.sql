-- The SQL interface: publish from any language inside the caller's own
-- transaction, with the guarantees of PgStore::publish_in (routes, per-key
-- sequence numbers, idempotent ids, atomic with the caller's commit, no
-- NOTIFY in the caller's commit). migrate.rs installs this file whenever its
-- text changes, with the line '--@publish.sql' replaced by sql/publish.sql:
-- the statement Store::publish runs is the one these functions run.
-- The functions that touch the store's tables or send the wake-up run with
-- a pinned search_path: pg_catalog first (no caller's function shadows a
-- built-in), the store's schema (its tables), pg_temp last (no temporary
-- table shadows the store's); the caller's own search_path plays no part.
-- The helpers they call (lane_of, new_event_id, check_event) run in that
-- path too; publish only calls publish_batch by its full name. Set here for
-- the installation only.
CREATE SCHEMA IF NOT EXISTS lanebus;
SELECT set_config('lanebus.installer_path', current_setting('search_path'), true),
       set_config('search_path', format('pg_catalog, %I, pg_temp', current_schema()), true);

-- Lane of a key: FNV-1a 64-bit of its UTF-8 bytes mod lanes
-- (store/src/lane.rs), on two 32-bit halves: prime 0x100000001b3 = 2^40 + 435.
CREATE OR REPLACE FUNCTION lanebus.lane_of(key text, lanes int) RETURNS int
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
DECLARE
    b  bytea  := convert_to($1, 'UTF8');
    hi bigint := 3421674724;  -- 0xcbf29ce4, the offset basis's high half
    lo bigint := 2216829733;  -- 0x84222325
    t  bigint;
BEGIN
    FOR i IN 0 .. length(b) - 1 LOOP
        lo := lo # get_byte(b, i);
        t := lo * 435;
        hi := (hi * 435 + lo * 256 + (t >> 32)) & 4294967295;
        lo := t & 4294967295;
    END LOOP;
    RETURN (((hi % $2) * (4294967296 % $2) + lo) % $2)::int;
END $fn$;

-- A new event id: a UUIDv7 (RFC 9562) of the database server's clock, as
-- generate_event_id makes on a node.
CREATE OR REPLACE FUNCTION lanebus.new_event_id() RETURNS text
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    b bytea := uuid_send(gen_random_uuid());
    ms bigint := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
BEGIN
    b := overlay(b PLACING substring(int8send(ms) FROM 3) FROM 1 FOR 6);
    b := set_byte(b, 6, (get_byte(b, 6) & 15) | 112);
    RETURN encode(b, 'hex')::uuid::text;
END $fn$;

-- A JSON number as the double Rust reads (serde_json): the nearest one,
-- 0 for a magnitude up to 2^-1075 (where the float8 cast raises instead).
-- filter_doc keeps out numbers whose nearest double is infinite.
CREATE OR REPLACE FUNCTION lanebus.filter_float(v jsonb) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
    SELECT CASE WHEN abs($1::numeric) <= 5::numeric ^ 1075 * 1e-1075 THEN 0 ELSE $1::float8 END
$fn$;

-- Type-strict equality of a payload value with a filter's scalar operand;
-- numbers by value as doubles (store/src/filter.rs).
CREATE OR REPLACE FUNCTION lanebus.filter_equal(v jsonb, x jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
    SELECT CASE WHEN jsonb_typeof($1) <> jsonb_typeof($2) THEN false
                WHEN jsonb_typeof($1) = 'number' THEN lanebus.filter_float($1) = lanebus.filter_float($2)
                ELSE $1 = $2 END
$fn$;

-- Whether payload document doc matches payload filter f: the semantics of
-- store/src/filter.rs (its tests and the conformance tests hold both to
-- the same answers). The JSON pointer is walked as serde_json does: a
-- member of an object, or an index 0, 1, ... without leading zeros of an
-- array; anything else is a missing value (SQL NULL, unlike JSON null).
CREATE OR REPLACE FUNCTION lanebus.filter_matches(f jsonb, doc jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
DECLARE
    item jsonb;
    v jsonb := doc;
    tok text;
BEGIN
    IF f ? 'and' THEN
        FOR item IN SELECT jsonb_array_elements(f -> 'and') LOOP
            IF NOT lanebus.filter_matches(item, doc) THEN
                RETURN false;
            END IF;
        END LOOP;
        RETURN true;
    ELSIF f ? 'or' THEN
        FOR item IN SELECT jsonb_array_elements(f -> 'or') LOOP
            IF lanebus.filter_matches(item, doc) THEN
                RETURN true;
            END IF;
        END LOOP;
        RETURN false;
    ELSIF f ? 'not' THEN
        RETURN NOT lanebus.filter_matches(f -> 'not', doc);
    END IF;
    IF f ->> 'path' <> '' THEN
        FOREACH tok IN ARRAY regexp_split_to_array(substr(f ->> 'path', 2), '/') LOOP
            tok := replace(replace(tok, '~1', '/'), '~0', '~');
            IF jsonb_typeof(v) = 'object' THEN
                v := v -> tok;
            ELSIF jsonb_typeof(v) = 'array' AND tok ~ '^(0|[1-9][0-9]{0,8})$' THEN
                v := v -> tok::int;
            ELSE
                v := NULL;
            END IF;
            EXIT WHEN v IS NULL;
        END LOOP;
    END IF;
    IF f ? 'exists' THEN
        RETURN (v IS NOT NULL) = (f -> 'exists')::boolean;
    ELSIF v IS NULL THEN
        RETURN false;
    ELSIF f ? 'equals' THEN
        RETURN lanebus.filter_equal(v, f -> 'equals');
    ELSIF f ? 'in' THEN
        RETURN EXISTS (SELECT 1 FROM jsonb_array_elements(f -> 'in') AS x (x)
                       WHERE lanebus.filter_equal(v, x.x));
    ELSIF jsonb_typeof(v) <> 'number' THEN
        RETURN false;
    ELSIF f ? 'gt' THEN
        RETURN lanebus.filter_float(v) > (f -> 'gt')::float8;
    ELSIF f ? 'gte' THEN
        RETURN lanebus.filter_float(v) >= (f -> 'gte')::float8;
    ELSIF f ? 'lt' THEN
        RETURN lanebus.filter_float(v) < (f -> 'lt')::float8;
    ELSIF f ? 'lte' THEN
        RETURN lanebus.filter_float(v) <= (f -> 'lte')::float8;
    END IF;
    RETURN false;
END $fn$;

-- A payload parsed for filters, once per event (publish.sql): NULL, which
-- matches no filter, where the Rust evaluator cannot parse it either (not
-- UTF-8 JSON, or a number whose nearest double is infinite). jsonb refuses
-- U+0000, so its escapes become U+FFFF, which no filter value or path may
-- hold (store/src/rules.rs): a string holding either equals no operand on
-- every store. Escaped backslashes are set aside first (as U+0001, which
-- valid JSON text never holds raw) so '\\u0000' stays a backslash and text.
-- PARALLEL UNSAFE: the EXCEPTION block starts a subtransaction.
CREATE OR REPLACE FUNCTION lanebus.filter_doc(payload bytea) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL UNSAFE AS $fn$
DECLARE
    t text := convert_from(payload, 'UTF8');
    doc jsonb;
BEGIN
    IF strpos(t, '\u0000') > 0 AND strpos(t, E'\x01') = 0 THEN
        t := replace(replace(replace(t, '\\', E'\x01'), '\u0000', '\uffff'), E'\x01', '\\');
    END IF;
    doc := t::jsonb;
    -- Only text with an exponent or 309 digits in a row can hold one.
    IF t ~ '[0-9][eE]|[0-9]{255}[0-9]{54}'
       AND jsonb_path_exists(doc, '$.** ? (@.type() == "number" && (@ >= $max || @ <= -$max))',
                             jsonb_build_object('max', 2::numeric ^ 1024 - 2::numeric ^ 970)) THEN
        RETURN NULL;
    END IF;
    RETURN doc;
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END $fn$;

-- Whether the payload bytes match filter f: filter_matches on filter_doc.
CREATE OR REPLACE FUNCTION lanebus.filter_payload(f jsonb, payload bytea) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL UNSAFE AS $fn$
    SELECT lanebus.filter_matches($1, lanebus.filter_doc($2))
$fn$;

-- The publish statement (sql/publish.sql), for publish_batch. Internal: its
-- parameters are publish.sql's, in its order. Its generic plan, as the
-- group writer's (store/src/postgres/publish.rs GROUP_SETTINGS: custom
-- plans cost more planning than execution).
DROP FUNCTION IF EXISTS lanebus.publish_rows(
    text[], text[], text[], int[], bytea[], bool[], timestamptz[], bool, bool);
CREATE OR REPLACE FUNCTION lanebus.publish_rows(
    text[], text[], text[], int[], bytea[], bool[], timestamptz[], bool, bool, bigint, text[],
    OUT o_accepted bigint, OUT o_deliveries bigint, OUT o_stored text[], OUT o_seqs bigint[])
LANGUAGE plpgsql SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    o_notified bigint;
    o_lanes int[];
    o_catalog bigint;
BEGIN
--@publish.sql
    INTO o_accepted, o_deliveries, o_notified, o_stored, o_seqs, o_lanes, o_catalog;
END $fn$;

-- Raises the broken rule of an event (store/src/rules.rs, event::check), as
-- SQLSTATE 22023 with the message 'events[i].field: ...'.
CREATE OR REPLACE FUNCTION lanebus.check_event(
    i int, type text, key text, payload jsonb, id text, deliver_at timestamptz,
    expected_seq bigint, t0 timestamptz) RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    pre text := format('events[%s].', $1);
    body text;
BEGIN
    IF $5 IS NOT NULL AND $5 !~ '^[!-~]{1,128}$' THEN
        RAISE EXCEPTION '%id: event id % must be 1 to 128 printable ASCII characters without spaces',
            pre, to_json($5) USING ERRCODE = '22023';
    END IF;
    IF $2 IS NULL OR $2 !~ '^[A-Za-z0-9._:/-]{1,128}$' THEN
        RAISE EXCEPTION '%type: event type % must be 1 to 128 characters of letters, digits and ._:/-',
            pre, coalesce(to_json($2)::text, 'null') USING ERRCODE = '22023';
    END IF;
    IF starts_with($2, 'lanebus.') THEN
        RAISE EXCEPTION '%type: event type % is reserved: types starting with "lanebus." are lanebus''s own operational events',
            pre, to_json($2) USING ERRCODE = '22023';
    END IF;
    IF $3 IS NOT NULL THEN
        IF octet_length(convert_to($3, 'UTF8')) NOT BETWEEN 1 AND 256 THEN
            RAISE EXCEPTION '%key: event key must be 1 to 256 bytes, got % bytes',
                pre, octet_length(convert_to($3, 'UTF8')) USING ERRCODE = '22023';
        END IF;
        IF $3 ~ '[\u0001-\u001f\u007f-\u009f]' THEN
            RAISE EXCEPTION '%key: event key % must not contain control characters',
                pre, to_json($3) USING ERRCODE = '22023';
        END IF;
    END IF;
    IF $7 IS NOT NULL THEN
        IF $7 < 0 THEN
            RAISE EXCEPTION '%expected_seq: expected_seq % must be 0 or more (0: the key has no event yet)',
                pre, $7 USING ERRCODE = '22023';
        END IF;
        IF $3 IS NULL THEN
            RAISE EXCEPTION '%expected_seq: expected_seq % needs a key: sequence numbers are per key, an unkeyed event has none',
                pre, $7 USING ERRCODE = '22023';
        END IF;
    END IF;
    IF $4 IS NULL THEN
        RAISE EXCEPTION '%payload: payload must be a JSON value, got NULL', pre USING ERRCODE = '22023';
    END IF;
    body := $4::text;
    IF octet_length(convert_to(body, 'UTF8')) > 1048576 THEN
        RAISE EXCEPTION '%payload: payload of % bytes exceeds the limit of 1048576 bytes',
            pre, octet_length(convert_to(body, 'UTF8')) USING ERRCODE = '22023';
    END IF;
    -- Nesting: 129 levels need 129 opening brackets; an array or object at
    -- level 128 (the root is level 0) is one level too deep.
    IF octet_length(body) > 128 THEN
        IF jsonb_path_exists($4, 'strict $.**{128} ? (@.type() == "array" || @.type() == "object")') THEN
            RAISE EXCEPTION '%payload: payload nests 129 or more arrays/objects deep; at most 128 are allowed (receivers'' JSON parsers refuse deeper)',
                pre USING ERRCODE = '22023';
        END IF;
    END IF;
    -- A string delivery would open as a personal field's envelope
    -- (rules::event::no_envelope). jsonb keeps no escapes, so one written
    -- escaped is stored plain and refused too; the shape is checked, not
    -- whether its base64 decodes.
    IF strpos(body, '"lbenc:v1:') > 0 THEN
        IF jsonb_path_exists($4, 'strict $.** ? (@.type() == "string" && @ like_regex "^lbenc:v1:[A-Za-z0-9_-]*:[A-Za-z0-9+/]*=*$")') THEN
            RAISE EXCEPTION '%payload: the string reading as a personal field''s envelope (lbenc:v1:<base64url>:<base64>) is one only lanebus writes: delivery would decrypt it or send null',
                pre USING ERRCODE = '22023';
        END IF;
    END IF;
    IF NOT isfinite($6) THEN
        RAISE EXCEPTION '%deliver_at: deliver_at must be a finite time, got %', pre, $6
            USING ERRCODE = '22023';
    END IF;
    IF $6 > $8 + interval '168 hours' THEN
        RAISE EXCEPTION '%deliver_at: deliver_at % is more than 7 days ahead (latest %)',
            pre, $6, $8 + interval '168 hours' USING ERRCODE = '22023';
    END IF;
END $fn$;

-- Publishes a batch inside the caller's transaction: element i of each array
-- is event i (keys[i] NULL: unkeyed; ids[i] NULL: a new UUIDv7; deliver_at[i]
-- NULL: at once; expected_seqs[i]: the key's sequence expected just before
-- the event). Returns one row per input event, in order: its id, its
-- sequence number (NULL when unkeyed or not written by this call) and
-- whether it was a duplicate (an id already stored or repeated in the batch).
-- Errors: 22023 for a broken rule (the message names events[i] and the
-- field); LB409 for a broken expected_seq; 23505 or 40P01 when a concurrent
-- publish of the same id raced this one (retry the transaction); 40001 under
-- REPEATABLE READ or SERIALIZABLE as for any write. An error aborts the
-- caller's transaction (use a savepoint to keep it): nothing of the batch is
-- stored. The lanes that got deliveries are remembered in the session (reset
-- by a rollback) for lanebus.wake() after the commit.
CREATE OR REPLACE FUNCTION lanebus.publish_batch(
    types text[], keys text[], payloads jsonb[], ids text[] DEFAULT NULL,
    deliver_at timestamptz[] DEFAULT NULL, expected_seqs bigint[] DEFAULT NULL)
RETURNS TABLE (id text, seq bigint, duplicate boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $fn$
#variable_conflict use_column
DECLARE
    n int := coalesce(cardinality($1), 0);
    t0 timestamptz := clock_timestamp();
    n_lanes int;
    all_ids text[] := '{}';
    f_ids text[] := '{}';
    f_types text[] := '{}';
    f_keys text[] := '{}';
    f_lanes int[] := '{}';
    f_payloads bytea[] := '{}';
    f_client bool[] := '{}';
    f_at timestamptz[] := '{}';
    f_expect bigint[] := '{}';
    f_aliases text[] := '{}';
    only_cataloged boolean;
    cat record;
    w record;
    seq_of jsonb := '{}';
    first_of jsonb := '{}';
    woken int[] := '{}';
    j int := 0;
    e_id text;
    e_seq bigint;
    pending text;
BEGIN
    IF n > 1000 THEN
        RAISE EXCEPTION 'events: batch of % events exceeds the limit of 1000 events', n
            USING ERRCODE = '22023';
    END IF;
    IF coalesce(cardinality($2), n) <> n OR coalesce(cardinality($3), 0) <> n
       OR coalesce(cardinality($4), n) <> n OR coalesce(cardinality($5), n) <> n
       OR coalesce(cardinality($6), n) <> n THEN
        RAISE EXCEPTION 'events: types, keys, payloads, ids, deliver_at and expected_seqs must have one element per event (% types, % payloads)',
            n, coalesce(cardinality($3), 0) USING ERRCODE = '22023';
    END IF;
    IF array_ndims($1) > 1 OR array_lower($1, 1) <> 1
       OR array_ndims($2) > 1 OR array_lower($2, 1) <> 1
       OR array_ndims($3) > 1 OR array_lower($3, 1) <> 1
       OR array_ndims($4) > 1 OR array_lower($4, 1) <> 1
       OR array_ndims($5) > 1 OR array_lower($5, 1) <> 1
       OR array_ndims($6) > 1 OR array_lower($6, 1) <> 1 THEN
        RAISE EXCEPTION 'events: the arrays must be one-dimensional and start at index 1'
            USING ERRCODE = '22023';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;
    -- A store's lane count never changes: read once per session.
    n_lanes := nullif(current_setting('lanebus.lanes', true), '')::int;
    IF n_lanes IS NULL THEN
        SELECT m.value::int INTO STRICT n_lanes FROM meta m WHERE m.key = 'lanes';
        PERFORM set_config('lanebus.lanes', n_lanes::text, false);
    END IF;
    SELECT c.strict INTO STRICT only_cataloged FROM catalog c WHERE c.id = 0;
    FOR i IN 1 .. n LOOP
        PERFORM lanebus.check_event(i - 1, $1[i], $2[i], $3[i], $4[i], $5[i], $6[i], t0);
        -- The event-type catalog (store/src/event_types.rs): an alias is
        -- stored under its wire name; a type with a JSON Schema is refused
        -- (only lanebus's own publish paths validate payloads); with the
        -- strict setting, so is a type not in the catalog.
        SELECT t.name, t.schema IS NOT NULL AS has_schema,
               nullif(array_to_string(t.aliases, ' '), '') AS aliases INTO cat
        FROM event_type_names x JOIN event_types t ON t.name = x.wire
        WHERE x.name = $1[i];
        IF NOT FOUND THEN
            IF only_cataloged THEN
                RAISE EXCEPTION 'events[%].type: event type % is not in the catalog, and the store refuses types not in it',
                    i - 1, to_json($1[i]) USING ERRCODE = '22023';
            END IF;
        ELSIF cat.has_schema THEN
            RAISE EXCEPTION 'events[%].type: event type % has a JSON Schema, which only lanebus''s own publish (Store::publish, publish_in, the HTTP API) checks',
                i - 1, to_json($1[i]) USING ERRCODE = '22023';
        END IF;
        e_id := coalesce($4[i], lanebus.new_event_id());
        all_ids := all_ids || e_id;
        CONTINUE WHEN e_id = ANY (f_ids);
        f_ids := f_ids || e_id;
        f_types := f_types || coalesce(cat.name, $1[i]);
        f_aliases := f_aliases || cat.aliases;
        f_keys := f_keys || $2[i];
        f_lanes := f_lanes || lanebus.lane_of(coalesce($2[i], e_id), n_lanes);
        f_payloads := f_payloads || convert_to($3[i]::text, 'UTF8');
        f_client := f_client || ($4[i] IS NOT NULL);
        f_at := f_at || $5[i];
        f_expect := f_expect || $6[i];
    END LOOP;
    SELECT * INTO STRICT w
    FROM lanebus.publish_rows(f_ids, f_types, f_keys, f_lanes, f_payloads, f_client, f_at, false, true,
                              NULL, f_aliases);
    -- Sequence numbers of the events written (those not already stored), in
    -- order; expectations checked as store/src/common.rs check_expected.
    FOR k IN 1 .. cardinality(f_ids) LOOP
        CONTINUE WHEN f_ids[k] = ANY (coalesce(w.o_stored, '{}'));
        j := j + 1;
        e_seq := w.o_seqs[j];
        seq_of := seq_of || jsonb_build_object(f_ids[k], e_seq);
        woken := woken || f_lanes[k];
        IF f_keys[k] IS NOT NULL AND NOT first_of ? f_keys[k] THEN
            first_of := first_of || jsonb_build_object(f_keys[k], e_seq);
        END IF;
        IF f_expect[k] IS NOT NULL AND f_expect[k] <> e_seq - 1 THEN
            RAISE EXCEPTION 'events[%].expected_seq: key % was at sequence %, not at the expected %',
                array_position(all_ids, f_ids[k]) - 1, to_json(f_keys[k]),
                (first_of ->> f_keys[k])::bigint - 1, f_expect[k]
                USING ERRCODE = 'LB409', DETAIL = format('current_seq=%s', (first_of ->> f_keys[k])::bigint - 1);
        END IF;
    END LOOP;
    IF w.o_deliveries > 0 THEN
        pending := current_setting('lanebus.wake', true);
        IF coalesce(pending, '') = '' AND cardinality(woken) = 1 THEN
            PERFORM set_config('lanebus.wake', woken[1]::text, false);
        ELSIF pending IS DISTINCT FROM 'all' THEN
            SELECT array_agg(DISTINCT l ORDER BY l) INTO woken
            FROM unnest(woken || string_to_array(nullif(pending, ''), ',')::int[]) AS l;
            pending := CASE WHEN cardinality(woken) > 512 THEN 'all' ELSE array_to_string(woken, ',') END;
            PERFORM set_config('lanebus.wake', pending, false);
        END IF;
    END IF;
    FOR i IN 1 .. n LOOP
        id := all_ids[i];
        duplicate := NOT (seq_of ? id AND array_position(all_ids, id) = i);
        seq := CASE WHEN duplicate THEN NULL ELSE (seq_of ->> id)::bigint END;
        RETURN NEXT;
    END LOOP;
END $fn$;

-- Publishes one event inside the caller's transaction and returns its id
-- (as lanebus.publish_batch, which says what fails how).
CREATE OR REPLACE FUNCTION lanebus.publish(
    type text, key text, payload jsonb, id text DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL, expected_seq bigint DEFAULT NULL) RETURNS text
LANGUAGE plpgsql AS $fn$
DECLARE
    r text;
BEGIN
    SELECT b.id INTO STRICT r
    FROM lanebus.publish_batch(ARRAY[$1], ARRAY[$2], ARRAY[$3], ARRAY[$4], ARRAY[$5], ARRAY[$6]) b;
    RETURN r;
END $fn$;

-- Wakes the lane owners of every node (one NOTIFY) for what this session
-- published since its last wake-up, in committed transactions. Call it after
-- COMMIT, outside a transaction block: called inside one, its NOTIFY goes
-- with that commit and serializes it with other notifying commits. Without
-- it, events are claimed within the nodes' poll interval (1 s by default).
CREATE OR REPLACE FUNCTION lanebus.wake() RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $fn$
DECLARE
    pending text := current_setting('lanebus.wake', true);
BEGIN
    IF coalesce(pending, '') = '' THEN
        RETURN;
    END IF;
    PERFORM pg_notify('lanebus', CASE WHEN pending = 'all' THEN '' ELSE pending END);
    PERFORM set_config('lanebus.wake', '', false);
END $fn$;

SELECT set_config('search_path', current_setting('lanebus.installer_path'), true);
