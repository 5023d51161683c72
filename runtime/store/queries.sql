-- The statements that must be exact under concurrency, one named block each.
-- A block starts with "-- name --", then a one-line description, then the SQL.
-- Every state change is one statement that writes the new state (guarded by the old
-- status and, for leased work, the lease token) and its task_events rows together.
-- Parameters use SQLAlchemy's :name style; arrays are cast explicitly.
-- {tasks_channel} is replaced at load time by runtime.store.queries.TASKS_CHANNEL, the one
-- LISTEN/NOTIFY channel (NOTIFY's payload is the agent name, 'judge' for the judge stage).

-- fragment_root_status --
-- A root's status as inserted (task_insert_root, task_insert_roots_many,
-- task_insert_fork_root), from the column ``to_agent`` of its source row: the
-- require_approval policy holds it in 'awaiting_approval' when its agent is listed in
-- :approval_agents (as it holds a delegated task; approve_above_usd is a delegation rule:
-- a root has spent nothing); a question to a person is never held.
CASE WHEN to_agent <> 'human' AND to_agent = ANY(CAST(:approval_agents AS text[]))
     THEN 'awaiting_approval' ELSE 'pending' END

-- fragment_root_event_detail --
-- The detail of a root's first event, from its status as inserted.
CASE WHEN status = 'pending' THEN '' ELSE '; held for approval (policy require_approval)' END

-- task_insert_root --
-- Insert a root task (root_id = id) and its 'submitted' event; a repeated idempotency key
-- inserts nothing. Held for approval by fragment_root_status.
WITH ins AS (
    INSERT INTO tasks (id, root_id, from_agent, to_agent, type, hypothesis_id, payload,
                       success_criteria, kill_criteria, budget_tokens, budget_seconds,
                       budget_usd, priority, idempotency_key, request_hash, depth, tenant,
                       status)
    SELECT :id, :id, :from_agent, to_agent, :type, :hypothesis_id, CAST(:payload AS jsonb),
           CAST(:success_criteria AS jsonb), CAST(:kill_criteria AS jsonb), :budget_tokens,
           :budget_seconds, :budget_usd, :priority, :idempotency_key, :request_hash, 0,
           :tenant, {fragment_root_status}
    FROM (VALUES (CAST(:to_agent AS text))) AS v(to_agent)
    ON CONFLICT (idempotency_key) WHERE parent_id IS NULL AND idempotency_key IS NOT NULL
    DO NOTHING
    RETURNING *
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, NULL, status, :actor, 'submitted' || {fragment_root_event_detail} FROM ins
), notify AS (
    SELECT pg_notify('{tasks_channel}', to_agent) FROM ins WHERE status = 'pending'
)
SELECT ins.*, (SELECT count(*) FROM notify) AS notified FROM ins;

-- task_insert_roots_many --
-- Insert many root tasks in one statement (bulk submission; no idempotency keys), held
-- for approval by fragment_root_status.
WITH input AS (
    SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:agents AS text[]), CAST(:types AS text[]),
                         CAST(:payloads AS jsonb[]), CAST(:priorities AS int[]))
        AS i(id, to_agent, type, payload, priority)
), ins AS (
    INSERT INTO tasks (id, root_id, to_agent, type, payload, priority, depth, status)
    SELECT id, id, to_agent, type, payload, priority, 0, {fragment_root_status} FROM input
    RETURNING id, to_agent, status
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, NULL, status, :actor, 'submitted' || {fragment_root_event_detail} FROM ins
), notify AS (
    SELECT pg_notify('{tasks_channel}', a)
    FROM (SELECT DISTINCT to_agent AS a FROM ins WHERE status = 'pending') d
)
SELECT count(*) AS inserted, (SELECT count(*) FROM notify) AS notified FROM ins;

-- task_get_by_root_key --
-- Find the root task holding an idempotency key.
SELECT * FROM tasks WHERE parent_id IS NULL AND idempotency_key = :key;

-- fragment_claimable --
-- The tasks a claim may take: pending or ready to aggregate, for :agents, due, not a
-- question to a person, not in a paused tree, not of a tenant whose token bucket is dry.
-- A person answers questions to 'human'; no worker ever claims them. A paused tree's
-- tasks wait (tree_pauses is tiny: an anti-join on its key keeps the walk of
-- ix_tasks_claimable in order; test_steering pins the plan). Tenants in :dry_tenants (a
-- token bucket too low: tenant_buckets_dry) are not claimed.
status IN ('pending', 'ready_to_aggregate')
AND to_agent = ANY(CAST(:agents AS text[]))
AND available_at <= now()
AND to_agent <> 'human'
AND NOT EXISTS (SELECT 1 FROM tree_pauses z WHERE z.root_id = tasks.root_id)
AND tenant <> ALL(CAST(:dry_tenants AS text[]))

-- fragment_claim_picked --
-- The rest of a claim, after a CTE ``picked`` of the locked rows' places (``tid``):
-- move them to running under new leases, write their events, return them.
-- The move (fragment_claim_moved) and the row returned (fragment_claim_returned) are
-- shared with the hand-off (task_claim_handed), whose event says how it took the task.
{fragment_claim_moved}, ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    -- lease_token: the delivery's new token (the audit's promise 7 is per delivery).
    SELECT id, claimed_from, 'running', :worker,
           'claimed for ' || phase || ', delivery ' || delivery_count, lease_token
    FROM claimed
)
{fragment_claim_returned}

-- fragment_claim_moved --
-- A claim's move, as CTE ``claimed``: the rows of ``picked`` to running under new leases.
-- The picked rows are updated by their place in the table (ctid = ANY of an array: a TID
-- scan, whatever the estimates; 20% of a claim's execution against an index scan of
-- pk_tasks by id, and a join to picked was once planned as a sequential scan of the whole
-- table). The rows are locked, so nobody moves them and t.status is still what was
-- picked. A row that another transaction changed after this statement's snapshot, and
-- that still matched when locked, is at a place the snapshot does not see: it is not
-- claimed this time (it stays pending for the next claim).
claimed AS (
    UPDATE tasks t
    SET status = 'running',
        phase = CASE WHEN t.status = 'ready_to_aggregate' THEN 'aggregate' ELSE 'run' END,
        lease_owner = :worker,
        lease_token = gen_random_uuid(),
        lease_expires_at = now() + make_interval(secs => :lease_seconds),
        claimed_at = now(),
        deadline_at = now() + make_interval(secs => COALESCE(t.budget_seconds, 300)),
        started_at = COALESCE(t.started_at, now()),
        delivery_count = t.delivery_count + 1,
        updated_at = now()
    WHERE t.ctid = ANY(ARRAY(SELECT tid FROM picked))
    -- Where it came from, by the phase just set (pending -> run, ready -> aggregate).
    RETURNING {fragment_claimed_columns}, t.fair_at,
              CASE WHEN t.phase = 'aggregate' THEN 'ready_to_aggregate'
                   ELSE 'pending' END AS claimed_from
)

-- fragment_claim_returned --
-- What a claim returns for the rows of ``claimed`` (its last SELECT).
-- recorded_calls: whether a durable reply of this phase is on record (the model layer
-- looks replies up only then: a first delivery makes no lookup per call).
-- counterpart_calls (a fork's branch task only): its counterpart's successful replies of
-- this phase, the rows model_call_get_recorded_many would search there (replayed ones
-- too), read with the claim: a re-run's calls are answered without a look-up statement
-- and its round trip on their path. NULL for every other task (no subquery). json, not
-- jsonb: built as text, as it is sent (no binary form to make and print again); each
-- row's keys are its column names (json_agg of the row: the statement stays within
-- psycopg's query cache, MAX_SENT_CHARS).
SELECT c.*, EXISTS (SELECT 1 FROM model_calls m
                    WHERE m.task_id = c.id AND m.phase = c.phase AND m.error IS NULL
                      AND NOT m.replayed AND m.response IS NOT NULL) AS recorded_calls,
       CASE WHEN c.forked_from IS NOT NULL THEN (
           SELECT COALESCE(json_agg(r ORDER BY r.id), '[]') FROM (
               SELECT m.id, m.position, m.request_hash, m.response, m.thinking, m.model,
                      m.route, m.backend, m.prompt_tokens, m.completion_tokens, m.tool_calls
               FROM model_calls m
               WHERE m.task_id = c.forked_from AND m.phase = c.phase
                 AND m.error IS NULL AND m.response IS NOT NULL) r) END AS counterpart_calls
FROM claimed c
ORDER BY c.priority, c.fair_at

-- task_claim_available --
-- Claim up to :limit pending or ready-to-aggregate tasks for :agents, most urgent first, then earliest fair time.
-- When no tenant has a max_in_flight (task_claim_capped otherwise): one walk of
-- ix_tasks_claimable. The CTE selects and locks first: a LIMIT inside a CTE runs once, so
-- the planner cannot re-evaluate it per joined row and over-claim (Oban's basic engine
-- does the same). SKIP LOCKED lets concurrent workers pass over each other's rows
-- instead of waiting. fair_at (not created_at) orders the walk: a wide tree's later
-- children carry later fair times than a newer small tree's tasks
-- (runtime.config.SchedulerSettings). A claim of 160 against task_claim_capped with no
-- caps: 0.53 against 1.26 ms of planning, 5.8 against 7.9 ms of execution (PG15, EXPLAIN
-- ANALYZE, medians of 60).
WITH picked AS (
    SELECT ctid AS tid
    FROM tasks
    WHERE {fragment_claimable}
    ORDER BY priority, fair_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), {fragment_claim_picked};

-- task_claim_capped --
-- Claim up to :limit pending or ready-to-aggregate tasks for :agents, with the tenants' max_in_flight.
-- As task_claim_available; tenants with [tenants.<name>] max_in_flight (:cap_tenants,
-- :caps) are claimed apart, up to their room; the caller holds their advisory locks
-- (task_lock_tenants), so the room counted here sees every other claim of theirs that
-- committed.
WITH caps AS (
    -- Room from live leases only: a SIGKILLed worker's tasks stop counting when their
    -- leases expire, before the reaper moves them (no counter to leak).
    SELECT c.tenant,
           GREATEST(c.cap - (SELECT count(*) FROM tasks r
                             WHERE r.status = 'running' AND r.tenant = c.tenant
                               AND r.lease_expires_at > now()), 0) AS room
    FROM unnest(CAST(:cap_tenants AS text[]), CAST(:caps AS int[])) AS c(tenant, cap)
), free AS (
    SELECT ctid AS tid, priority, fair_at
    FROM tasks
    WHERE {fragment_claimable}
      AND tenant <> ALL(CAST(:cap_tenants AS text[]))
    ORDER BY priority, fair_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), capped AS (
    SELECT k.*
    FROM caps c
    CROSS JOIN LATERAL (
        SELECT ctid AS tid, priority, fair_at
        FROM tasks
        WHERE {fragment_claimable}
          AND tenant = c.tenant
        ORDER BY priority, fair_at
        LIMIT LEAST(c.room, :limit)
        FOR UPDATE SKIP LOCKED
    ) k
), picked AS (
    -- Rows locked here but not picked stay locked only until this transaction ends.
    SELECT tid FROM (SELECT * FROM free UNION ALL SELECT * FROM capped) a
    ORDER BY priority, fair_at
    LIMIT :limit
), {fragment_claim_picked};

-- task_claim_in_trees --
-- Claim up to :limit pending or ready-to-aggregate tasks for :agents, only in the trees of :roots.
-- What `orgchart run` and orgchart.Client.run claim: the tree they submitted, never a
-- goal someone else queued (its model calls are someone else's money). The roots' trees
-- are read through the (root_id) index, then ordered as task_claim_available orders
-- them; that statement (the workers' hot path) keeps its plan. Capped tenants keep
-- their max_in_flight: the caller passes the caps (empty arrays when none) and holds
-- task_lock_tenants for them, and the claim takes at most the least room among the
-- capped tenants of these roots (a tree's tasks carry its root's tenant).
WITH room AS (
    SELECT GREATEST(c.cap - (SELECT count(*) FROM tasks r
                             WHERE r.status = 'running' AND r.tenant = c.tenant
                               AND r.lease_expires_at > now()), 0) AS room
    FROM unnest(CAST(:cap_tenants AS text[]), CAST(:caps AS int[])) AS c(tenant, cap)
    WHERE c.tenant IN (SELECT tenant FROM tasks WHERE id = ANY(CAST(:roots AS uuid[])))
), picked AS (
    SELECT ctid AS tid
    FROM tasks
    WHERE {fragment_claimable}
      AND root_id = ANY(CAST(:roots AS uuid[]))
    ORDER BY priority, fair_at
    -- LEAST ignores the NULL min() of no capped tenant.
    LIMIT LEAST(:limit, (SELECT min(room) FROM room))
    FOR UPDATE SKIP LOCKED
), {fragment_claim_picked};

-- task_lock_tenants --
-- Take the claim's lock of each tenant in :tenants (sorted by the caller: one order, no
-- deadlock) until the transaction ends: claims of a capped tenant queue here, so each
-- counts the others' committed claims (task_claim_available runs next, with a new snapshot).
SELECT count(pg_advisory_xact_lock(hashtextextended('orgchart.tenant:' || t, 0)))
FROM unnest(CAST(:tenants AS text[])) AS u(t);

-- fragment_judging_leased --
-- The judge stage's lease of the rows a CTE ``picked`` chose (their places, ctid, as
-- task_claim_available): status unchanged, a fresh token; each row says whether its
-- judge already has a recorded call (a redelivery replays it).
UPDATE tasks t
SET lease_owner = :worker,
    lease_token = gen_random_uuid(),
    lease_expires_at = now() + make_interval(secs => :lease_seconds),
    claimed_at = now(),
    delivery_count = t.delivery_count + 1,
    updated_at = now()
WHERE t.ctid = ANY(ARRAY(SELECT tid FROM picked))
RETURNING {fragment_claimed_columns}, 'judging' AS claimed_from,
          EXISTS (SELECT 1 FROM model_calls m
                  WHERE m.task_id = t.id AND m.phase = 'judge' AND m.error IS NULL
                    AND NOT m.replayed AND m.response IS NOT NULL) AS recorded_calls

-- task_claim_judging --
-- Lease up to :limit tasks waiting in 'judging' for the judge stage (status unchanged).
WITH picked AS (
    SELECT ctid AS tid
    FROM tasks
    WHERE status = 'judging' AND lease_token IS NULL
      AND NOT EXISTS (SELECT 1 FROM tree_pauses z WHERE z.root_id = tasks.root_id)
    ORDER BY priority, created_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
{fragment_judging_leased};

-- worker_list_live_signs --
-- Signs that a live worker claims work now: what `submit` reads to warn that nothing will run a goal.
-- Three, any one enough: a worker session (worker_sessions, migration 0016) of this
-- server's incarnation whose backend still holds an advisory lock (PostgreSQL drops it
-- when the process dies); a maintenance pass (every worker with maintenance runs one per
-- interval) within :recent_seconds; a live lease (a worker is working; ix_tasks_leased
-- finds one in a step). Workers do not record which agents they serve: a live worker of
-- other agents counts too.
SELECT (SELECT count(*) FROM worker_sessions s
        WHERE s.server_started_at = pg_postmaster_start_time()
          -- Its backend still holds its liveness lock (worker_session_register's keys).
          AND EXISTS (SELECT 1 FROM pg_locks l
                      WHERE l.pid = s.backend_pid AND l.locktype = 'advisory'
                        AND l.granted AND l.objsubid = 2
                        AND l.objid = CAST(s.lock_key AS oid))) AS sessions,
       COALESCE((SELECT max(last_at) FROM maintenance_passes)
                > now() - make_interval(secs => :recent_seconds), false) AS maintained,
       EXISTS (SELECT 1 FROM tasks
               WHERE lease_token IS NOT NULL AND lease_expires_at > now()) AS leased;

-- task_claim_judging_in_trees --
-- Lease up to :limit tasks waiting in 'judging' for the judge stage, only in the trees of :roots.
-- As task_claim_judging, for a worker that runs one tree (task_claim_in_trees).
WITH picked AS (
    SELECT ctid AS tid
    FROM tasks
    WHERE status = 'judging' AND lease_token IS NULL
      AND root_id = ANY(CAST(:roots AS uuid[]))
      AND NOT EXISTS (SELECT 1 FROM tree_pauses z WHERE z.root_id = tasks.root_id)
    ORDER BY priority, created_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
{fragment_judging_leased};

-- task_heartbeat_leased --
-- Extend the leases a worker still holds; the tokens not returned were taken away.
-- Rows are locked in id order and rows locked right now are skipped (SKIP LOCKED): a
-- heartbeat over a thousand leases never waits on, or deadlocks with, the worker's own
-- outcome writes. A skipped row whose token is still there is returned too (held, not
-- extended this time: it is being written, or the next beat extends it).
WITH target AS (
    SELECT id FROM tasks
    WHERE lease_token = ANY(CAST(:tokens AS uuid[]))
    ORDER BY id
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE tasks t
    SET lease_expires_at = now() + make_interval(secs => :lease_seconds)
    FROM target
    -- target's rows are locked, their tokens checked on their latest versions (a lock
    -- that waited re-checks them): the join is on the key alone. With the tokens here
    -- too, the planner, which counts few leased rows in a queue's statistics, walked the
    -- leased rows once per target row (1,000 leases: 250 ms, a million rows filtered).
    WHERE t.id = target.id
    RETURNING t.id, t.lease_token
)
SELECT lease_token FROM upd
UNION ALL
SELECT lease_token FROM tasks
WHERE lease_token = ANY(CAST(:tokens AS uuid[])) AND id NOT IN (SELECT id FROM target);

-- fragment_claimed_columns --
-- The columns a claim returns: those the engine reads from a claimed TaskRow (its other
-- fields keep their defaults: created_at, started_at, completed_at, available_at,
-- updated_at, lease_owner, lease_expires_at, rolled_*, hypothesis_id).
-- All 52 columns of t.* cost the worker 16 us of psycopg per claimed row, these 8 to 9
-- (bench/drain_parts.py; tests/unit/test_claimed_columns.py checks the engine reads no
-- other column of a claimed row).
t.id, t.to_agent, t.type, t.payload, t.status, t.parent_id, t.root_id, t.from_agent,
t.success_criteria, t.kill_criteria, t.budget_tokens, t.budget_seconds, t.budget_usd,
t.priority, t.result, t.error, t.depth, t.phase, t.lease_token, t.claimed_at,
t.deadline_at, t.delivery_count, t.retry_count, t.idempotency_key, t.request_hash,
t.own_tokens, t.own_usd, t.spent_tokens, t.spent_usd, t.duration_seconds, t.route,
t.route_reason, t.model, t.verdict, t.forked_from, t.model_override, t.tenant

-- fragment_lock_batch --
-- Lock the rows of a batch of outcomes (a CTE ``input`` with ``id`` and ``token``) deepest
-- first, then by id: the order task_cancel_subtree locks a subtree in. A batch finishing
-- siblings and a cancel of their tree then wait for each other instead of deadlocking
-- (each would hold a row the other needs). Only rows still under the batch's lease tokens
-- are locked (re-checked after a wait): a late worker's batch locks, and waits on, nothing
-- another worker now holds. The UPDATE that follows checks the status these locked rows
-- carry (``l.status``): nobody can change it until the statement's transaction ends. Not
-- ``t.status`` there: the planner, which counts few running rows in a queue's statistics,
-- then walked a partial index on running rows once per batch row (a 296-row finish in a
-- drain: 65 ms, 44,000 index rows read); the join on the primary key cannot take that.
-- The token comes out too: the UPDATE joins its input on (id, token), so a batch holding
-- two outcomes of one task (a late delivery's and the current one's, from a worker that
-- claimed the task again) applies the current one only, never the late one in its place.
-- rolled_tokens and rolled_usd as locked: task_finish_running rolls an ending child's
-- spend up with its move and returns what it added (its spend less these).
SELECT t.id, t.status, i.token, t.rolled_tokens, t.rolled_usd
FROM tasks t JOIN input i ON i.id = t.id
WHERE t.lease_token = i.token
ORDER BY t.depth DESC, t.id
FOR UPDATE OF t

-- fragment_replays_insert --
-- The replayed calls a delivery served from the record (``stamp->'replays'``, zero cost:
-- runtime.llm.calls.HeldReplays) as model_calls rows, written with its outcome and fenced
-- like it: a delivery that never ends writes none, and the next one replays them again.
-- Followed by ``FROM <the updated rows> u`` and fragment_replays_lateral.
INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
    prompt, response, prompt_tokens, completion_tokens, duration_seconds, cost_usd, error,
    phase, position, request_hash, attempt_kind, call_try, replayed, thinking, tool_calls,
    created_at)
SELECT u.id, u.root_id, r.attempt, r.call_index, r.backend, r.route, r.model, r.prompt,
    r.response, 0, 0, 0, 0, NULL, r.phase, r.position, r.request_hash, 'call', 0,
    true, r.thinking, r.tool_calls, COALESCE(r.at, now())

-- fragment_replays_lateral --
-- The rows of ``u.replays`` (see fragment_replays_insert).
CROSS JOIN LATERAL jsonb_to_recordset(u.replays) AS r(
    attempt int, call_index int, backend text, route text, model text, prompt text,
    response text, phase text, position text, request_hash text, thinking text,
    tool_calls jsonb, at timestamptz)

-- task_finish_running --
-- Move leased running tasks to judging, failed, escalated or back to pending (a retry
-- with backoff), one row per input; rows whose lease token no longer matches are skipped.
-- A row that carries a verdict was judged inline by a worker that also runs the judge
-- stage: it goes through 'judging' to its final status, and both transitions are
-- recorded, in order, by the one INSERT below. A row with skips_judging had nothing to
-- judge (no criteria): one transition, running -> done, its detail saying so.
-- The batch arrives as one JSON array (one json.dumps on the client, one parse here).
-- Its rows are locked first, deepest first, then by id (fragment_lock_batch): the order
-- of a cancel, so a batch and a cancel of the same siblings never deadlock.
-- A child that ends (a terminal status) is rolled up by the same row version (budget rule
-- 6, as task_roll_up_children would, in the next statement, as a second version of the
-- row): rolled_* become its spend, and rolled_tokens/rolled_usd returned are what its
-- parent gets (its spend since the last roll-up), added by task_add_children_spend.
WITH input AS (
    -- ends: it reaches a terminal status
    SELECT *, to_status IN ('done', 'failed', 'escalated', 'cancelled') AS ends
    FROM jsonb_to_recordset(CAST(:batch AS jsonb))
        AS i(id uuid, token uuid, to_status text, result jsonb, error text,
        delay double precision, detail text, verdict jsonb, stamp jsonb, skips_judging boolean)
), locked AS MATERIALIZED (
    {fragment_lock_batch}
), upd AS (
    UPDATE tasks t
    SET status = i.to_status,
        result = COALESCE(i.result, t.result),
        error = i.error,
        verdict = COALESCE(i.verdict, t.verdict),
        -- What ran (the agent's version, the prompts it rendered, merged over phases).
        agent_version = COALESCE(i.stamp->>'version', t.agent_version),
        prompt_hashes = CASE WHEN i.stamp IS NULL THEN t.prompt_hashes ELSE
            COALESCE(t.prompt_hashes, '{}') || COALESCE(i.stamp->'prompts', '{}') END,
        -- A task that only replayed calls shows the route and model of its last one.
        route = COALESCE(t.route, i.stamp->'replays'->-1->>'route'),
        route_reason = COALESCE(t.route_reason, i.stamp->'replays'->-1->>'route_reason'),
        model = COALESCE(t.model, i.stamp->'replays'->-1->>'model'),
        lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        delivery_count = CASE WHEN i.to_status = 'pending' THEN t.delivery_count ELSE 0 END,
        retry_count = t.retry_count + CASE WHEN i.to_status = 'pending' THEN 1 ELSE 0 END,
        available_at = CASE WHEN i.to_status = 'pending'
            THEN now() + make_interval(secs => i.delay) ELSE t.available_at END,
        duration_seconds = t.duration_seconds + extract(epoch FROM clock_timestamp() - t.claimed_at),
        completed_at = CASE WHEN i.ends THEN now() ELSE t.completed_at END,
        rolled_tokens = CASE WHEN i.ends THEN t.spent_tokens ELSE t.rolled_tokens END,
        rolled_usd = CASE WHEN i.ends THEN t.spent_usd ELSE t.rolled_usd END,
        updated_at = now()
    FROM input i JOIN locked l ON l.id = i.id AND l.token = i.token
    -- the guard: fragment_lock_batch
    WHERE t.id = l.id AND l.status = 'running'
    RETURNING t.id, t.parent_id, t.status, t.to_agent, i.detail, t.root_id, i.token,
        i.verdict IS NOT NULL AND i.skips_judging IS NOT TRUE AS judged,
        i.stamp->'replays' AS replays,
        t.rolled_tokens - l.rolled_tokens AS tokens, t.rolled_usd - l.rolled_usd AS usd
), replays AS (
    -- The calls this delivery served from the record, written with its outcome.
    {fragment_replays_insert}
    FROM upd u
    {fragment_replays_lateral}
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    -- lease_token: the token it held (the audit's promise 7 is per delivery).
    SELECT id, from_status, to_status, :worker, detail, token
    FROM (SELECT id, 'running' AS from_status,
            CASE WHEN judged THEN 'judging' ELSE status END AS to_status,
            CASE WHEN judged THEN 'result ready for judging' ELSE detail END AS detail,
            1 AS step, token
        FROM upd
        UNION ALL
        SELECT id, 'judging', status, detail, 2, token FROM upd WHERE judged) e
    ORDER BY id, step
), notify AS (
    SELECT pg_notify('{tasks_channel}', CASE WHEN s = 'judging' THEN 'judge' ELSE a END)
    FROM (SELECT DISTINCT status AS s, to_agent AS a FROM upd
        WHERE status IN ('judging', 'pending')) d
)
SELECT id, parent_id, status, tokens, usd, (SELECT count(*) FROM notify) AS notified
FROM upd;

-- task_finish_judging --
-- Record the judge's verdict and move leased judging tasks to done, failed or escalated.
-- Rows are locked in a cancel's order first (fragment_lock_batch).
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb))
        AS i(id uuid, token uuid, to_status text, verdict jsonb, error text, detail text)
), locked AS MATERIALIZED (
    {fragment_lock_batch}
), upd AS (
    UPDATE tasks t
    SET status = i.to_status,
        verdict = i.verdict,
        error = i.error,
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        completed_at = now(),
        updated_at = now()
    FROM input i JOIN locked l ON l.id = i.id AND l.token = i.token
    WHERE t.id = l.id AND l.status = 'judging'  -- the guard: fragment_lock_batch
    RETURNING t.id, t.parent_id, t.status, i.detail, i.token
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, 'judging', status, :worker, detail, token FROM upd
)
SELECT id, parent_id, status FROM upd;

-- task_lock_parents --
-- Lock the parents of children that just ended, deepest first, then by id (a cancel's
-- order), before their spend is rolled up and the fan-in check runs: two transactions
-- finishing the last two children of one parent serialise and the second sees the first.
SELECT id FROM tasks
WHERE id = ANY(CAST(:ids AS uuid[]))
ORDER BY depth DESC, id
FOR UPDATE;

-- task_roll_up_children --
-- Children that reached a terminal status hand their spend not yet rolled up to their
-- parent: marks it rolled and returns the difference per child (a child retried by its
-- parent's aggregate rolls up only what it spent since). The parents are then updated by
-- task_add_children_spend in the same transaction. Budget rule 6 (runtime/budget.py).
-- Roots are left out by COALESCE, not by "parent_id IS NOT NULL": that test matches the
-- predicate of ix_tasks_parent_id_status, whose walk (every child in the table, filtered
-- by id) looked free when the statistics knew few children (test_fresh_plans).
UPDATE tasks c
SET rolled_tokens = c.spent_tokens, rolled_usd = c.spent_usd
FROM (
    SELECT id, rolled_tokens, rolled_usd FROM tasks
    WHERE id = ANY(CAST(:ids AS uuid[]))
      AND COALESCE(parent_id, id) <> id
      AND status IN ('done', 'failed', 'escalated', 'cancelled')
      AND (spent_tokens <> rolled_tokens OR spent_usd <> rolled_usd)
) old
WHERE c.id = old.id
RETURNING c.parent_id, c.spent_tokens - old.rolled_tokens AS tokens,
          c.spent_usd - old.rolled_usd AS usd;

-- task_add_children_spend --
-- Add finished children's spend to their (locked) parents: one row per parent.
-- Budget rule 6 (runtime/budget.py: sum_by_parent adds the children up per parent).
UPDATE tasks p
SET spent_tokens = p.spent_tokens + x.tokens, spent_usd = p.spent_usd + x.usd
FROM unnest(CAST(:ids AS uuid[]), CAST(:tokens AS bigint[]), CAST(:usd AS numeric[]))
    AS x(id, tokens, usd)
WHERE p.id = x.id
RETURNING p.id;

-- task_flip_ready_parents --
-- Fan-in at once: the given waiting parents whose children are all terminal become ready.
-- OFFSET 0 keeps NOT EXISTS a probe of ix_tasks_parent_id_status per parent: as an anti
-- join, statistics that knew few children let it walk every child once per parent.
WITH upd AS (
    UPDATE tasks p
    SET status = 'ready_to_aggregate', delivery_count = 0, updated_at = now()
    WHERE p.id = ANY(CAST(:ids AS uuid[]))
      AND p.status = 'waiting'
      AND NOT EXISTS (
          SELECT 1 FROM tasks c
          WHERE c.parent_id = p.id AND c.status NOT IN ('done', 'failed', 'escalated', 'cancelled')
          OFFSET 0)
    RETURNING p.id, p.to_agent
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'waiting', 'ready_to_aggregate', :worker, 'fan-in: last child finished' FROM upd
), notify AS (
    -- Not for :quiet_agents: the caller offers those parents to its own worker
    -- (task_claim_handed) and announces the ones it did not take (task_notify_waiting).
    SELECT pg_notify('{tasks_channel}', a)
    FROM (SELECT DISTINCT to_agent AS a FROM upd
          WHERE to_agent <> ALL(CAST(:quiet_agents AS text[]))) d
)
SELECT id, to_agent, (SELECT count(*) FROM notify) AS notified FROM upd;

-- task_claim_handed --
-- Lease to this worker, as a claim would, tasks its own write just made claimable (:ids).
-- The hand-off (docs/architecture.md, "Fan-out and fan-in"): the worker that finished a
-- parent's last child takes the parent's aggregate (the parents task_flip_ready_parents
-- flipped), the worker that delegated takes the children it inserted, in the same
-- transaction: no claim round trip and no notification. Only what this worker's next
-- claim could take: claimable for :agents (fragment_claimable: due, not for 'human', not
-- in a paused tree, not of a tenant whose bucket may be dry: the caller passes every
-- metered tenant as :dry_tenants), not of a tenant with a max_in_flight (:cap_tenants:
-- its room is counted by the claim, under task_lock_tenants), and with no other
-- claimable task for :agents ahead of it in the claim's order (priority, fair_at): a
-- hand-off never jumps the fair queue. At most :limit (the worker's free room). The rows
-- are this transaction's own (parents locked by task_lock_parents, children inserted by
-- it): the lock never waits. Then exactly as a claim (fragment_claim_picked: the same
-- lease columns and returned row), the event's detail ending with :claim_note.
-- ``ahead``: the first other claimable task in the claim's order, found by one walk of
-- ix_tasks_claimable for the whole statement, that ends at the last offered task
-- (``last``, a row comparison on the index's leading columns) and passes over :ids. A
-- probe per offered task, each walking past the same :ids again, read 411,000 index rows
-- and fetched 405,000 heap rows on the 931-task tree (1,216 probes; bench.peers): a
-- quarter of the buffers the whole tree touched.
WITH last AS MATERIALIZED (
    SELECT priority, fair_at FROM tasks
    WHERE id = ANY(CAST(:ids AS uuid[]))
    ORDER BY priority DESC, fair_at DESC
    LIMIT 1
), ahead AS MATERIALIZED (
    SELECT a.priority, a.fair_at FROM last l, tasks a
    WHERE a.status IN ('pending', 'ready_to_aggregate')
      AND (a.priority, a.fair_at) < (l.priority, l.fair_at)
      AND a.to_agent = ANY(CAST(:agents AS text[]))
      AND a.available_at <= now()
      AND a.id <> ALL(CAST(:ids AS uuid[]))
      AND NOT EXISTS (SELECT 1 FROM tree_pauses z WHERE z.root_id = a.root_id)
    ORDER BY a.priority, a.fair_at
    LIMIT 1
), picked AS (
    SELECT ctid AS tid
    FROM tasks
    WHERE id = ANY(CAST(:ids AS uuid[]))
      AND {fragment_claimable}
      AND tenant <> ALL(CAST(:cap_tenants AS text[]))
      AND NOT EXISTS (SELECT 1 FROM ahead x
                      WHERE (x.priority, x.fair_at) < (tasks.priority, tasks.fair_at))
    ORDER BY priority, fair_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), {fragment_claim_moved}, ev AS (
    -- A claim's event (fragment_claim_picked), its detail saying which hand-off took it.
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, claimed_from, 'running', :worker,
           'claimed for ' || phase || ', delivery ' || delivery_count
           || CAST(:claim_note AS text), lease_token
    FROM claimed
)
{fragment_claim_returned};

-- task_notify_waiting --
-- Announce the tasks of :ids still waiting for a claim, for :agents: those a hand-off left.
-- task_flip_ready_parents and task_delegate_running_many do not announce the agents a
-- hand-off is offered (:quiet_agents); what task_claim_handed did not take is announced
-- here, in the same transaction (a notification is delivered at commit).
SELECT count(pg_notify('{tasks_channel}', a)) AS notified
FROM (SELECT DISTINCT to_agent AS a FROM tasks
      WHERE id = ANY(CAST(:ids AS uuid[]))
        AND status IN ('pending', 'ready_to_aggregate')
        AND to_agent = ANY(CAST(:agents AS text[]))) d;

-- task_sweep_ready_parents --
-- The fan-in sweeper (seed 003): every waiting parent whose children are all terminal
-- becomes ready_to_aggregate, set-based, in one statement. The safety net behind the flip.
-- A probe per parent (OFFSET 0, as task_flip_ready_parents), and the update finds the
-- ready parents by id (= ANY): a join to ``ready`` was planned as a nested loop pairing
-- every waiting row with every ready one when the statistics knew no waiting rows.
WITH ready AS (
    SELECT p.id
    FROM tasks p
    WHERE p.status = 'waiting'
      AND NOT EXISTS (
          SELECT 1 FROM tasks c
          WHERE c.parent_id = p.id AND c.status NOT IN ('done', 'failed', 'escalated', 'cancelled')
          OFFSET 0)
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE tasks t
    SET status = 'ready_to_aggregate', delivery_count = 0, updated_at = now()
    WHERE t.id = ANY(ARRAY(SELECT id FROM ready)) AND t.status = 'waiting'
    RETURNING t.id, t.to_agent
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'waiting', 'ready_to_aggregate', :worker, 'fan-in sweep: all children terminal'
    FROM upd
), notify AS (
    SELECT pg_notify('{tasks_channel}', a) FROM (SELECT DISTINCT to_agent AS a FROM upd) d
)
SELECT id, (SELECT count(*) FROM notify) AS notified FROM upd;

-- task_delegate_running_many --
-- Fan-out of a batch of parents (one JSON array: id, token, detail, children): each leased
-- parent goes to 'waiting' and its children are inserted, in one statement; the parents
-- are locked first, in a cancel's order (fragment_lock_batch; two batches never
-- deadlock). A parent whose lease is gone changes nothing and gets no children. Children
-- are unique per (parent_id, idempotency_key), so a parent that runs again after a crash or a retry inserts only
-- the children it does not have yet. Returns one row per parent that was moved, with
-- the children inserted for it.
-- In a branch (a fork's tree, docs/writing-agents.md), each child whose counterpart exists
-- (the original parent's child with the same key) is linked to it by forked_from, and the
-- child the fork named gets the fork's overrides (agent, type, payload, model); a child
-- inherits its parent's model_override. Outside a branch p.forked_from is NULL and the
-- two joins find nothing.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb))
        AS i(id uuid, token uuid, detail text, children jsonb, stamp jsonb)
), locked AS MATERIALIZED (
    {fragment_lock_batch}
), parent AS (
    UPDATE tasks t
    SET status = 'waiting',
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        delivery_count = 0,
        duration_seconds = t.duration_seconds
                           + extract(epoch FROM clock_timestamp() - t.claimed_at),
        agent_version = COALESCE(i.stamp->>'version', t.agent_version),
        prompt_hashes = CASE WHEN i.stamp IS NULL THEN t.prompt_hashes
                             ELSE COALESCE(t.prompt_hashes, '{}') || COALESCE(i.stamp->'prompts', '{}')
                        END,
        route = COALESCE(t.route, i.stamp->'replays'->-1->>'route'),
        route_reason = COALESCE(t.route_reason, i.stamp->'replays'->-1->>'route_reason'),
        model = COALESCE(t.model, i.stamp->'replays'->-1->>'model'),
        updated_at = now()
    FROM input i JOIN locked l ON l.id = i.id AND l.token = i.token
    WHERE t.id = l.id AND l.status = 'running'  -- the guard: fragment_lock_batch
    RETURNING t.id, t.root_id, t.depth, t.to_agent, t.priority, i.detail, i.children,
              -- The tree's spend so far, read only when [policies] approve_above_usd is
              -- set (a CASE runs its subquery only in the branch taken).
              CASE WHEN CAST(:approve_above_usd AS numeric) IS NULL THEN 0
                   ELSE (SELECT COALESCE(sum(m.cost_usd), 0) FROM model_calls m
                         WHERE m.root_id = t.root_id) END AS tree_spend,
              t.forked_from, t.model_override, t.agent_map, t.tenant,
              i.stamp->'replays' AS replays, i.token
), replays AS (
    -- The calls this delivery served from the record, written with its outcome.
    {fragment_replays_insert}
    FROM parent u
    {fragment_replays_lateral}
), spans AS (
    -- Fair time (runtime.config.SchedulerSettings): each tree's tasks are one step apart
    -- (:fair_quantum over its tenant's weight); ``before``: the tree's children listed by
    -- the parents of this batch ahead of this one.
    SELECT p.id, p.root_id, jsonb_array_length(p.children) AS n,
           COALESCE(sum(jsonb_array_length(p.children)) OVER (
               PARTITION BY p.root_id ORDER BY p.id
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before,
           CAST(:fair_quantum AS float8)
           / COALESCE((SELECT w.weight FROM unnest(CAST(:tenant_names AS text[]),
                                                   CAST(:tenant_weights AS float8[]))
                           AS w(name, weight) WHERE w.name = p.tenant), 1) AS step
    FROM parent p
), clock AS (
    -- Each tree's clock moves past the fair times handed out here (one row per tree,
    -- locked in root order: two batches of one tree's delegations take turns, never
    -- deadlock). base: the clock before, or now when it is behind (no banked credit).
    -- factor: the tree's cost per call over fair_quantum_tokens (migration 0012; >= 1),
    -- learnt by the charges (task_charge_running_many): its steps are that much longer.
    INSERT INTO tree_clocks AS tc (root_id, clock)
    SELECT root_id, now() + make_interval(secs => sum(n * step)) FROM spans
    GROUP BY root_id ORDER BY root_id
    ON CONFLICT (root_id) DO UPDATE
        SET clock = GREATEST(now(), tc.clock) + (excluded.clock - now()) * tc.factor
    RETURNING tc.root_id, tc.factor,
              tc.clock - (SELECT make_interval(secs => sum(x.n * x.step)) FROM spans x
                          WHERE x.root_id = tc.root_id) * tc.factor AS base
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, 'running', 'waiting', :worker, detail, token FROM parent
), kids AS (
    INSERT INTO tasks (id, parent_id, root_id, from_agent, to_agent, type, payload,
                       success_criteria, kill_criteria, budget_tokens, budget_seconds,
                       budget_usd, priority, idempotency_key, depth, created_at, status,
                       forked_from, model_override, agent_map, tenant, fair_at)
    -- clock_timestamp() keeps siblings in the order the agent listed them.
    -- The require_approval policy (issue 22) holds a child in 'awaiting_approval' when its
    -- agent is listed in :approval_agents, or when its budget would take the tree's spend
    -- past :approve_above_usd; a question to a person is never held.
    SELECT c.id, p.id, p.root_id, p.to_agent, eff.to_agent,
           CASE WHEN f.named THEN COALESCE(r.fork->>'type', c.type) ELSE c.type END,
           CASE WHEN f.named AND r.fork ? 'payload' THEN r.fork->'payload' ELSE c.payload END,
           c.success_criteria, c.kill_criteria, c.budget_tokens, c.budget_seconds,
           c.budget_usd, COALESCE(c.priority, p.priority), c.key, p.depth + 1,
           clock_timestamp(),
           CASE WHEN eff.to_agent = 'human' THEN 'pending'
                WHEN eff.to_agent = ANY(CAST(:approval_agents AS text[]))
                  OR p.tree_spend + c.budget_usd > CAST(:approve_above_usd AS numeric)
                THEN 'awaiting_approval'
                ELSE 'pending' END,
           o.id,
           CASE WHEN f.named THEN COALESCE(r.fork->>'model', p.model_override)
                ELSE p.model_override END,
           p.agent_map,
           -- The tree's tenant; the fair time: the tree's clock before this statement
           -- (clock.base) plus one step per task delegated in the tree before this one,
           -- never later than the child's creation plus :max_wait (nothing starves).
           p.tenant,
           LEAST(clock_timestamp() + make_interval(secs => CAST(:max_wait AS float8)),
                 k.base + make_interval(secs => s.step * k.factor * (s.before + c.n)))
    FROM parent p
    JOIN spans s ON s.id = p.id
    JOIN clock k ON k.root_id = p.root_id
    CROSS JOIN LATERAL jsonb_to_recordset(p.children) AS c(
             id uuid, to_agent text, type text, payload jsonb, success_criteria jsonb,
             kill_criteria jsonb, budget_tokens int, budget_seconds int,
             budget_usd numeric, priority int, key text, n int)
    -- The counterpart: the original parent's child with the same key (unique index).
    LEFT JOIN tasks o ON p.forked_from IS NOT NULL AND o.parent_id = p.forked_from
                     AND o.idempotency_key = c.key
    LEFT JOIN tasks r ON o.id IS NOT NULL AND r.id = p.root_id
    CROSS JOIN LATERAL (SELECT COALESCE(o.id = CAST(r.fork->>'target' AS uuid), false)
                        AS named) f
    -- An experiment's variant (runtime/experiments) swaps agents tree-wide: agent_map,
    -- set on the branch's root and inherited like model_override, maps a delegated name
    -- to the agent that runs in its place. NULL outside such a branch.
    CROSS JOIN LATERAL (SELECT CASE WHEN f.named THEN COALESCE(r.fork->>'agent', c.to_agent)
                                    ELSE COALESCE(p.agent_map->>c.to_agent, c.to_agent)
                               END AS to_agent) eff
    ON CONFLICT (parent_id, idempotency_key)
        WHERE parent_id IS NOT NULL AND idempotency_key IS NOT NULL
    DO NOTHING
    RETURNING id, parent_id, to_agent, status
), kev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, NULL, status, :worker,
           CASE WHEN status = 'pending' THEN 'delegated by parent'
                ELSE 'delegated by parent; held for approval (policy require_approval)' END
    FROM kids
), notify AS (
    -- Not for :quiet_agents: the caller offers those children to its own worker
    -- (task_claim_handed) and announces the ones it did not take (task_notify_waiting).
    SELECT pg_notify('{tasks_channel}', a)
    FROM (SELECT DISTINCT to_agent AS a FROM kids WHERE status = 'pending'
          AND to_agent <> ALL(CAST(:quiet_agents AS text[]))) d
)
SELECT p.id, COALESCE(k.inserted, 0) AS inserted,
       (SELECT count(*) FROM notify) AS notified
FROM parent p
LEFT JOIN (SELECT parent_id, count(*) AS inserted FROM kids GROUP BY parent_id) k
    ON k.parent_id = p.id;

-- task_retry_children --
-- An aggregating parent sends finished children back to pending (optionally to another
-- agent) and itself goes back to 'waiting', in one statement guarded by its lease.
WITH parent AS (
    UPDATE tasks
    SET status = 'waiting',
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        delivery_count = 0,
        duration_seconds = duration_seconds + extract(epoch FROM clock_timestamp() - claimed_at),
        updated_at = now()
    WHERE id = :id AND status = 'running' AND lease_token = :token
    RETURNING id
), pev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, 'running', 'waiting', :worker, :detail, CAST(:token AS uuid) FROM parent
), old AS (
    -- Lock the children and read the status they leave: an UPDATE's RETURNING only sees
    -- the new row, so the event's from_status comes from here (as in task_reap_expired).
    SELECT c.id, c.status
    FROM tasks c
    WHERE c.parent_id = :id
      AND c.id = ANY(CAST(:child_ids AS uuid[]))
      AND c.status IN ('failed', 'escalated')
    FOR UPDATE
), kids AS (
    UPDATE tasks c
    SET status = 'pending',
        to_agent = COALESCE(CAST(:reassign_to AS text), c.to_agent),
        phase = 'run',
        result = NULL,
        error = NULL,
        verdict = NULL,
        completed_at = NULL,
        available_at = now(),
        delivery_count = 0,
        retry_count = c.retry_count + 1,
        updated_at = now()
    FROM parent p, old o
    WHERE c.parent_id = p.id
      AND c.id = o.id
      AND c.status IN ('failed', 'escalated')
    RETURNING c.id, o.status AS old_status, c.to_agent
), kev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, old_status, 'pending', :worker, :detail FROM kids
), notify AS (
    SELECT pg_notify('{tasks_channel}', a) FROM (SELECT DISTINCT to_agent AS a FROM kids) d
)
SELECT (SELECT count(*) FROM parent) AS parents, (SELECT count(*) FROM kids) AS children,
       (SELECT count(*) FROM notify) AS notified;

-- task_charge_running --
-- Charge one model call to the leased task's own spend and record the call. Only this
-- task's row is touched (no ancestor: the spend rolls up when the task ends), so a
-- thousand leaves of one tree never queue on their root. Budget rule 5
-- (runtime/budget.py; :usd is runtime.budget.call_cost of the call's tokens).
WITH me AS (
    UPDATE tasks
    SET own_tokens = own_tokens + :tokens,
        own_usd = own_usd + :usd,
        spent_tokens = spent_tokens + :tokens,
        spent_usd = spent_usd + :usd,
        route = :route,
        route_reason = :route_reason,
        model = :model,
        updated_at = now()
    WHERE id = :id AND lease_token = :token
    RETURNING id, root_id
)
INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                         prompt, response, prompt_tokens, completion_tokens,
                         duration_seconds, cost_usd, error, phase, position, request_hash,
                         attempt_kind, call_try, replayed, thinking, tool_calls)
SELECT id, root_id, :attempt, :call_index, :backend, :route, :model, :prompt, :response,
       :prompt_tokens, :completion_tokens, :duration_seconds, :usd, :error, :phase,
       :position, :request_hash, :attempt_kind, :call_try, :replayed, :thinking,
       CAST(:tool_calls AS jsonb)
FROM me
RETURNING task_id;

-- model_call_find_recorded --
-- Which of a batch of model calls (one JSON array) are already recorded. Asked only after
-- a COMMIT of charges whose outcome is unknown (the connection broke after it was sent):
-- the calls that landed are not charged again. A call is known by its task, delivery
-- (attempt), index, try, kind, phase and position (served by ix_model_calls_task_id_attempt).
SELECT i.n
FROM jsonb_to_recordset(CAST(:batch AS jsonb))
    AS i(n int, id uuid, attempt int, call_index int, call_try int, attempt_kind text,
         phase text, position text)
WHERE EXISTS (
    SELECT 1 FROM model_calls m
    WHERE m.task_id = i.id AND m.attempt = i.attempt AND m.call_index = i.call_index
      AND m.call_try = i.call_try AND m.attempt_kind = i.attempt_kind
      AND m.phase = i.phase AND m.position IS NOT DISTINCT FROM i.position
);

-- model_call_mark_failed --
-- Give a model call's row, recorded (and charged) the moment its reply arrived, the error
-- found when the reply was checked (a structured reply that does not fit): the record
-- look-up (model_call_get_recorded_many) then skips it, as it skips any failed request.
-- Fenced like a charge: the task row is read FOR SHARE with the lease token (a cancelled
-- task's late reply too, as task_charge_running_many records it), so a worker whose lease
-- was taken away changes nothing. The row is known as model_call_find_recorded knows it,
-- and has no error yet (the newest such row: served by ix_model_calls_task_id_attempt).
WITH me AS (
    SELECT id FROM tasks
    WHERE id = :task_id AND (lease_token = :token OR status = 'cancelled')
    FOR SHARE
), target AS (
    SELECT m.id FROM model_calls m JOIN me ON m.task_id = me.id
    WHERE m.attempt = :attempt AND m.call_index = :call_index
      AND m.call_try = :call_try AND m.attempt_kind = :attempt_kind AND m.phase = :phase
      AND m.position IS NOT DISTINCT FROM CAST(:position AS text)
      AND m.request_hash IS NOT DISTINCT FROM CAST(:request_hash AS text)
      AND m.error IS NULL AND NOT m.replayed
    ORDER BY m.id DESC
    LIMIT 1
)
UPDATE model_calls m
SET error = :error
FROM target
WHERE m.id = target.id
RETURNING m.id;

-- task_charge_running_many --
-- Charge a batch of model calls (one JSON array) in one statement: each task's row gets
-- the sum of its calls, guarded by its lease token; a call whose lease is gone changes
-- nothing and is not recorded (unless its task was cancelled: see below). Returns the
-- input positions that were recorded, with their task's parent and status.
-- Budget rule 5, as task_charge_running (runtime/budget.py).
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb))
        AS i(n int, id uuid, token uuid, tokens bigint, usd numeric, route text,
             route_reason text, model text, attempt int, call_index int, backend text,
             prompt text, response text, prompt_tokens int, completion_tokens int,
             duration_seconds double precision, error text, phase text, position text,
             request_hash text, attempt_kind text, call_try int, replayed boolean,
             thinking text, tool_calls jsonb)
), per_task AS (
    -- One row per task: the sums of its calls, and the route of its last call (a sort,
    -- not a join of the batch with itself: that was quadratic in the batch's size).
    SELECT DISTINCT ON (id, token) id, token, route, route_reason, model,
           sum(tokens) OVER task AS tokens, sum(usd) OVER task AS usd,
           count(*) OVER task AS calls
    FROM input
    WINDOW task AS (PARTITION BY id, token)
    ORDER BY id, token, n DESC
), me AS (
    UPDATE tasks t
    SET own_tokens = t.own_tokens + p.tokens,
        own_usd = t.own_usd + p.usd,
        spent_tokens = t.spent_tokens + p.tokens,
        spent_usd = t.spent_usd + p.usd,
        route = p.route,
        route_reason = p.route_reason,
        model = p.model,
        updated_at = now()
    FROM per_task p
    WHERE t.id = p.id AND (t.lease_token = p.token
                           -- A cancelled task's calls answered before its worker stopped
                           -- are still recorded: the money was spent. None of its calls
                           -- starts after the cancel (the model-call gate).
                           OR t.status = 'cancelled')
    RETURNING t.id, t.root_id, p.token, t.parent_id, t.status, p.tokens, p.calls
), calls AS (
    INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                             prompt, response, prompt_tokens, completion_tokens,
                             duration_seconds, cost_usd, error, phase, position,
                             request_hash, attempt_kind, call_try, replayed, thinking,
                             tool_calls)
    SELECT i.id, me.root_id, i.attempt, i.call_index, i.backend, i.route, i.model, i.prompt,
           i.response, i.prompt_tokens, i.completion_tokens, i.duration_seconds, i.usd,
           i.error, i.phase, i.position, i.request_hash, i.attempt_kind, i.call_try,
           i.replayed, i.thinking, i.tool_calls
    FROM input i JOIN me ON me.id = i.id AND me.token = i.token
    ORDER BY i.n
), cost AS (
    -- Cost-weighted fair time (migration 0012): each tree that has a clock adds what its
    -- calls spent, and its factor becomes its tokens per call over fair_tokens (at
    -- least 1). Clocks are locked in root order, after the tasks (as a delegation does).
    -- A factor moves only by more than a quarter (drift: a respacing is rare).
    SELECT root_id, old, new, tokens, calls,
           new NOT BETWEEN old * 0.8 AND old * 1.25 AS drift
    FROM (
        SELECT c.root_id, c.factor AS old, r.tokens, r.calls,
               GREATEST(1.0, (c.spent + r.tokens) / GREATEST(c.calls + r.calls, 1)
                             / CAST(:fair_tokens AS float8)) AS new
        FROM tree_clocks c
        JOIN (SELECT root_id, sum(tokens) AS tokens, sum(calls) AS calls
              FROM me GROUP BY root_id) r ON r.root_id = c.root_id
        ORDER BY c.root_id
        FOR UPDATE OF c
    ) l
), frontier AS (
    -- A drifting tree's frontier: its first pending fair time (now, if that is past).
    SELECT k.root_id,
           GREATEST(now(), (SELECT min(p.fair_at) FROM tasks p
                            WHERE p.root_id = k.root_id AND p.status = 'pending')) AS at
    FROM cost k WHERE k.drift
), clocks AS (
    -- The tree's clock and (below) its pending tasks are respaced by the ratio after its
    -- frontier: its next task keeps its place, the ones after it move apart (or closer).
    UPDATE tree_clocks c
    SET spent = c.spent + k.tokens,
        calls = c.calls + k.calls,
        factor = CASE WHEN k.drift THEN k.new ELSE c.factor END,
        clock = CASE WHEN k.drift AND c.clock > f.at
                     THEN f.at + (c.clock - f.at) * (k.new / k.old) ELSE c.clock END
    FROM cost k LEFT JOIN frontier f ON f.root_id = k.root_id
    WHERE c.root_id = k.root_id
    RETURNING c.root_id, k.old, k.new, k.drift, f.at
), respaced AS (
    UPDATE tasks t
    SET fair_at = LEAST(t.created_at + make_interval(secs => CAST(:max_wait AS float8)),
                        k.at + (t.fair_at - k.at) * (k.new / k.old))
    FROM clocks k
    WHERE k.drift AND t.root_id = k.root_id AND t.status = 'pending' AND t.fair_at > k.at
)
SELECT i.n, me.id, me.parent_id, me.status
FROM input i JOIN me ON me.id = i.id AND me.token = i.token;

-- model_call_spend_by_root --
-- The live spend of one tree, summed from its model calls (index on root_id): what the
-- tree has spent so far, including tasks still running.
-- Tools' costs (task_steps.cost_usd) count too.
SELECT COALESCE(sum(prompt_tokens + completion_tokens), 0) AS tokens,
       COALESCE(sum(cost_usd), 0)
       + (SELECT COALESCE(sum(cost_usd), 0) FROM task_steps WHERE root_id = :root_id) AS usd,
       count(*) AS calls
FROM model_calls WHERE root_id = :root_id;

-- fragment_release_columns --
-- The columns of a task taken back from a holder that is gone (its lease expired, or its
-- process died): back where it was claimed from (pending for a run, ready_to_aggregate
-- for an aggregate, an unleased judging for the judge), or, at retry.max_delivery
-- deliveries, poison: failed, its error saying why (:poison_why, the statement's words).
status = CASE
        WHEN t.delivery_count >= :max_delivery THEN 'failed'
        WHEN t.status = 'judging' THEN 'judging'
        WHEN t.phase = 'aggregate' THEN 'ready_to_aggregate'
        ELSE 'pending' END,
    error = CASE
        WHEN t.delivery_count >= :max_delivery
        THEN 'poison: delivered ' || t.delivery_count || ' times' || CAST(:poison_why AS text)
             || ' (retry.max_delivery = ' || :max_delivery || ')'
        ELSE t.error END,
    completed_at = CASE WHEN t.delivery_count >= :max_delivery THEN now()
                        ELSE t.completed_at END,
    lease_owner = NULL,
    lease_token = NULL,
    lease_expires_at = NULL,
    updated_at = now()

-- task_reap_expired --
-- The reaper: tasks whose lease expired go back to where they were claimed from
-- (pending, ready_to_aggregate, or unleased judging); past retry.max_delivery they are
-- poison and end failed. A heartbeat that landed after the statement's snapshot keeps its
-- task: the CTE's lock re-checks the lease condition on the row's latest version, and the
-- UPDATE joins on the key alone (with the lease condition there too, the planner walked
-- every expired lease once per expired row: 1,000 of them took 275 ms).
WITH expired AS (
    SELECT id, status, lease_token
    FROM tasks
    WHERE lease_token IS NOT NULL AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE tasks t
    SET {fragment_release_columns}
    FROM expired e
    WHERE t.id = e.id
    RETURNING t.id, t.parent_id, t.to_agent, e.status AS from_status, t.status AS to_status,
              t.delivery_count, e.lease_token
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, from_status, to_status, :worker,
           CASE WHEN to_status = 'failed' THEN 'poison: lease expired on delivery ' || delivery_count
                ELSE 'lease expired on delivery ' || delivery_count || '; released' END,
           lease_token  -- the token that expired
    FROM upd
), notify AS (
    SELECT pg_notify('{tasks_channel}', CASE WHEN s = 'judging' THEN 'judge' ELSE a END)
    FROM (SELECT DISTINCT to_status AS s, to_agent AS a FROM upd WHERE to_status <> 'failed') d
)
SELECT id, parent_id, from_status, to_status, (SELECT count(*) FROM notify) AS notified
FROM upd;

-- worker_session_register --
-- Take a worker incarnation's liveness lock and, only if taken, write its worker_sessions row.
-- The lock is session-level (two int4 keys: :namespace, :key) and lives as long as this
-- connection's session: when the process dies, PostgreSQL ends the session and frees it,
-- and task_reap_dead_owners takes the owner's tasks back. The row is written from this
-- very session, with the server's start time (a restart or a failover changes it) and
-- this backend, so whenever the row is visible its lock is held. A key another session
-- holds (a hash collision, or this owner's previous session not yet ended) returns no
-- row: the caller tries the next key (the row names the key it holds).
WITH lock AS (
    SELECT pg_try_advisory_lock(:namespace, :key) AS locked
)
INSERT INTO worker_sessions AS s (owner, lock_key, server_started_at, backend_pid,
                                  registered_at)
SELECT :owner, :key, pg_postmaster_start_time(), pg_backend_pid(), clock_timestamp()
FROM lock WHERE locked
ON CONFLICT (owner) DO UPDATE
SET lock_key = EXCLUDED.lock_key,
    server_started_at = EXCLUDED.server_started_at,
    backend_pid = EXCLUDED.backend_pid,
    registered_at = EXCLUDED.registered_at
RETURNING s.owner, s.lock_key, s.server_started_at, s.backend_pid;

-- task_reap_dead_owners --
-- Take back at once the tasks of worker processes that died while this server ran.
-- SIGKILL, an OOM kill, a crash: instead of waiting for their leases to expire. An owner
-- (tasks.lease_owner) whose worker_sessions row names this server's start time and whose
-- liveness lock (worker_session_register) nobody holds has lost its session: its process
-- is gone (or its connection broke, and fencing refuses what it writes later). Its tasks
-- go back where they were claimed from, as in task_reap_expired (the same states, the
-- same poison rule, SKIP LOCKED against other passes). After a restart or a failover the
-- start time differs: live workers that have not reconnected yet are not taken for
-- dead, and leases decide. A task claimed after this statement began is not taken
-- (claimed_at < now()): an incarnation reusing a dead owner's name registers, so takes
-- its lock, before it claims. Rows of unlocked owners are deleted (see gone), each only
-- as it was read (registered_at): a worker that registered again meanwhile keeps its.
WITH locks AS (
    -- The liveness locks held now. A two-int4 advisory lock shows as classid = key 1,
    -- objid = key 2 (as oid: a negative key reads as its unsigned value) and objsubid = 2
    -- (PostgreSQL 15 and 18); advisory locks belong to one database.
    SELECT l.objid
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.classid = CAST(:namespace AS oid)
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
), unlocked AS (
    SELECT s.owner, s.registered_at,
           s.server_started_at = pg_postmaster_start_time() AS this_run
    FROM worker_sessions s
    WHERE NOT EXISTS (SELECT 1 FROM locks l WHERE l.objid = CAST(s.lock_key AS oid))
), lost AS (
    SELECT t.id, t.status, t.lease_token
    FROM tasks t
    WHERE t.lease_token IS NOT NULL
      AND t.lease_owner IN (SELECT owner FROM unlocked WHERE this_run)
      AND t.claimed_at < now()
      -- Nobody dead (the usual case): a one-time filter, the tasks are not read at all.
      AND EXISTS (SELECT 1 FROM unlocked WHERE this_run)
    ORDER BY t.lease_expires_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE tasks t
    SET {fragment_release_columns}
    FROM lost l
    WHERE t.id = l.id
    RETURNING t.id, t.parent_id, t.to_agent, l.status AS from_status, t.status AS to_status,
              t.delivery_count, l.lease_token
), ev AS (
    -- "released" and "poison:" start the details the audit knows as not the holder's.
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, from_status, to_status, :worker,
           CASE WHEN to_status = 'failed'
                THEN 'poison: its worker''s session ended on delivery ' || delivery_count
                ELSE 'released: its worker''s session ended on delivery ' || delivery_count
           END,
           lease_token
    FROM upd
), notify AS (
    SELECT pg_notify('{tasks_channel}', CASE WHEN s = 'judging' THEN 'judge' ELSE a END)
    FROM (SELECT DISTINCT to_status AS s, to_agent AS a FROM upd WHERE to_status <> 'failed') d
), gone AS (
    -- An unlocked row of another server run goes at once (its owner's tasks are the
    -- leases' to decide; a live owner registers again as it reconnects); one of this run
    -- once its owner holds nothing (the next pass, for the tasks this one took back).
    DELETE FROM worker_sessions s
    USING unlocked u
    WHERE s.owner = u.owner AND s.registered_at = u.registered_at
      AND (NOT u.this_run
           OR NOT EXISTS (SELECT 1 FROM tasks t
                          WHERE t.lease_owner = u.owner AND t.lease_token IS NOT NULL))
)
SELECT id, parent_id, from_status, to_status, (SELECT count(*) FROM notify) AS notified
FROM upd;

-- maintenance_pass_begin --
-- Start a maintenance pass (reaper, watchdog, sweeper) if no other worker is running one
-- (a transaction-level advisory lock: the others skip, and it is released at commit) and
-- none ran in the last :interval seconds. Returns a row only when this worker should run it.
WITH lock AS (
    SELECT pg_try_advisory_xact_lock(:key) AS locked
)
INSERT INTO maintenance_passes AS m (name, last_at)
SELECT :name, now() FROM lock WHERE locked
ON CONFLICT (name) DO UPDATE SET last_at = now()
WHERE m.last_at <= now() - make_interval(secs => :interval)
RETURNING name;

-- task_fail_timed_out --
-- The watchdog (seed 003): a task running past its deadline_at (set at claim to
-- now() + budget_seconds; a partial index on running rows) ends failed with 'timeout'.
-- Clearing the lease token makes the late worker's completion a no-op.
WITH late AS (
    SELECT id, lease_token
    FROM tasks
    WHERE status = 'running' AND deadline_at < now()
      -- A paused tree's tasks are not timed out while paused (resume moves their
      -- deadlines on by the pause: tree_pause_delete).
      AND NOT EXISTS (SELECT 1 FROM tree_pauses z WHERE z.root_id = tasks.root_id)
    ORDER BY deadline_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE tasks t
    SET status = 'failed',
        error = 'timeout',
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        duration_seconds = t.duration_seconds + extract(epoch FROM clock_timestamp() - t.claimed_at),
        completed_at = now(),
        updated_at = now()
    FROM late l
    WHERE t.id = l.id  -- late's lock re-checked status and deadline on the latest version
    RETURNING t.id, t.parent_id, t.budget_seconds, l.lease_token
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, 'running', 'failed', :worker,
           'timeout: ran past budget_seconds = ' || COALESCE(budget_seconds, 300), lease_token
    FROM upd
)
SELECT id, parent_id FROM upd;

-- task_resolve_escalated --
-- A person (or a higher agent) resolves an escalated task: back to pending (retry,
-- optionally reassigned), or to done or failed. Guarded by status = 'escalated'.
WITH upd AS (
    UPDATE tasks
    SET status = :to_status,
        to_agent = COALESCE(CAST(:reassign_to AS text), to_agent),
        phase = 'run',
        error = CASE WHEN :to_status = 'pending' THEN NULL ELSE COALESCE(:error, error) END,
        completed_at = CASE WHEN :to_status = 'pending' THEN NULL ELSE now() END,
        available_at = now(),
        delivery_count = 0,
        updated_at = now()
    WHERE id = :id AND status = 'escalated'
    RETURNING id, parent_id, to_agent, status
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'escalated', status, :actor, :detail FROM upd
), notify AS (
    SELECT pg_notify('{tasks_channel}', to_agent) FROM upd WHERE status = 'pending'
)
SELECT id, parent_id, status, (SELECT count(*) FROM notify) AS notified FROM upd;

-- task_lock_by_id --
-- Lock one task for a decision taken in Python (a resolution), returning what it needs.
SELECT id, status, parent_id FROM tasks WHERE id = :id FOR UPDATE;

-- task_unready_parent --
-- A resolution retries a child of a parent that was ready to aggregate: the parent waits
-- again for it. Guarded by the parent's status; its event is written by the same statement.
WITH upd AS (
    UPDATE tasks
    SET status = 'waiting', updated_at = now()
    WHERE id = :id AND status = 'ready_to_aggregate'
    RETURNING id
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'ready_to_aggregate', 'waiting', :actor, 'a child was retried by a resolution'
    FROM upd
)
SELECT count(*) AS n FROM upd;

-- task_get --
-- One task by id, with which backends served its calls (fragment_task_served).
SELECT n.*, CAST({fragment_served_by_json} AS jsonb) AS served_by,
       COALESCE(s.estimated, false) AS cost_estimated
FROM tasks n CROSS JOIN LATERAL {fragment_task_served} s WHERE n.id = :id;

-- task_find_by_id_prefix --
-- The tasks whose id starts with a prefix a person typed (an id as `tree` prints it: 8
-- hex characters), at most :limit, in id order; the CLI resolves a unique one.
-- The prefix arrives as the range [:lo, :hi] (padded with 0s and with fs): a range on
-- the uuid is answered by the primary key, where id::text LIKE 'abcd%' reads every row.
-- uuid order is byte order, the order of the hex text, so the range is exactly the prefix.
SELECT id, root_id, parent_id, to_agent, status, created_at
FROM tasks
WHERE id >= CAST(:lo AS uuid) AND id <= CAST(:hi AS uuid)
ORDER BY id
LIMIT :limit;

-- task_list_children --
-- The children of one task, in creation order.
SELECT * FROM tasks WHERE parent_id = :id ORDER BY created_at, id;

-- task_list_tree --
-- Every node of one tree, parents before children (one index scan on root_id), with
-- which backends served each one's calls (fragment_task_served).
SELECT n.*, CAST({fragment_served_by_json} AS jsonb) AS served_by,
       COALESCE(s.estimated, false) AS cost_estimated
FROM tasks n CROSS JOIN LATERAL {fragment_task_served} s
WHERE n.root_id = :root_id ORDER BY n.depth, n.created_at, n.id;

-- task_list_events --
-- The history of one task, oldest first.
SELECT * FROM task_events WHERE task_id = :id ORDER BY id;

-- task_list_model_calls --
-- The model calls made for one task, oldest first.
SELECT * FROM model_calls WHERE task_id = :id ORDER BY id;

-- task_list_escalated --
-- The escalation inbox, oldest first, with each task's root goal.
SELECT t.*, r.payload AS root_payload,
       (SELECT max(e.at) FROM task_events e
        WHERE e.task_id = t.id AND e.to_status = 'escalated') AS escalated_at
FROM tasks t JOIN tasks r ON r.id = t.root_id
WHERE t.status = 'escalated'
ORDER BY t.completed_at NULLS LAST, t.created_at;

-- task_list_roots_recent --
-- The most recent root tasks.
SELECT * FROM tasks WHERE parent_id IS NULL ORDER BY created_at DESC LIMIT :limit;

-- task_count_by_status --
-- How many tasks are in each status.
SELECT status, count(*) AS n FROM tasks GROUP BY status;

-- task_count_pending --
-- The depth of the pending queue (for routing).
SELECT count(*) FROM tasks WHERE status = 'pending';

-- task_queue_by_agent --
-- Claimable work per agent (the orchestrator's view of the queue), most urgent first.
SELECT to_agent, count(*) AS n, min(priority) AS top_priority, min(created_at) AS oldest
FROM tasks
WHERE status IN ('pending', 'ready_to_aggregate') AND available_at <= now() + interval '1 minute'
  AND to_agent <> 'human'
GROUP BY to_agent
UNION ALL
SELECT 'judge', count(*), min(priority), min(created_at)
FROM tasks WHERE status = 'judging' AND lease_token IS NULL
HAVING count(*) > 0;

-- task_metrics --
-- The seed's metrics: retries, reclaimed work, mean duration.
SELECT COALESCE(avg(retry_count), 0) AS avg_retry,
       COALESCE(avg(duration_seconds) FILTER (WHERE status = 'done'), 0) AS avg_duration_seconds,
       (SELECT count(DISTINCT task_id) FROM task_events
        WHERE worker = 'reaper') AS reclaimed_count
FROM tasks;

-- model_call_cost_by_route --
-- Total cost and tokens of model calls per route.
SELECT route, sum(cost_usd) AS cost_usd, sum(prompt_tokens + completion_tokens) AS tokens,
       count(*) AS calls
FROM model_calls GROUP BY route ORDER BY route;

-- model_call_cost_by_backend --
-- Calls, tokens and cost of model calls per backend that served them (a call answered
-- from the record counts as "replay"), and the part of the cost that is an estimate: the
-- price of a routed model that did not run (offline, a replay of a recorded run; budgets
-- count it all the same).
SELECT CASE WHEN replayed THEN 'replay' ELSE backend END AS backend, count(*) AS calls,
       sum(prompt_tokens + completion_tokens) AS tokens, sum(cost_usd) AS cost_usd,
       COALESCE(sum(cost_usd) FILTER (WHERE backend IN ('offline', 'replay')), 0)
           AS estimated_usd
FROM model_calls GROUP BY 1 ORDER BY 1;

-- model_call_count_kinds --
-- Model call rows that were repairs, in-call retries, or served from the record.
SELECT count(*) FILTER (WHERE attempt_kind = 'repair') AS repairs,
       count(*) FILTER (WHERE attempt_kind = 'retry') AS retries,
       count(*) FILTER (WHERE replayed) AS replays
FROM model_calls;

-- task_list_stranded --
-- Work that needs hygiene: expired leases, and waiting parents whose children are all terminal.
SELECT id, status, to_agent, 'lease expired' AS why
FROM tasks WHERE lease_token IS NOT NULL AND lease_expires_at < now()
UNION ALL
SELECT p.id, p.status, p.to_agent, 'waiting parent with all children terminal'
FROM tasks p
WHERE p.status = 'waiting'
  AND NOT EXISTS (SELECT 1 FROM tasks c WHERE c.parent_id = p.id
                  AND c.status NOT IN ('done', 'failed', 'escalated', 'cancelled'));

-- task_delete_finished_trees --
-- Remove whole finished trees whose root completed before :before (or, with :before NULL,
-- the finished trees whose roots :roots names: a deleted experiment's), with their events
-- and their delivered webhook events (and the delivered ones of no tree sent before
-- :before).
-- Every row of a candidate tree is locked first, SKIP LOCKED: a tree with a row another
-- transaction holds (a resolution reopening a task) is passed over, never waited for,
-- and a tree is deleted only when all its rows were locked here and are still finished.
WITH candidates AS (
    SELECT r.id
    FROM tasks r
    WHERE r.parent_id IS NULL
      AND r.status IN ('done', 'failed', 'escalated', 'cancelled')
      AND (CAST(:before AS timestamptz) IS NULL OR r.completed_at < :before)
      AND (CAST(:roots AS uuid[]) IS NULL OR r.id = ANY(CAST(:roots AS uuid[])))
), locked AS (
    SELECT t.id, t.root_id, t.status
    FROM tasks t
    WHERE t.root_id IN (SELECT id FROM candidates)
    FOR UPDATE SKIP LOCKED
), old_roots AS (
    SELECT l.root_id AS id
    FROM locked l
    GROUP BY l.root_id
    HAVING bool_and(l.status IN ('done', 'failed', 'escalated', 'cancelled'))
       AND count(*) = (SELECT count(*) FROM tasks x WHERE x.root_id = l.root_id)
), gone AS (
    DELETE FROM tasks t USING old_roots o WHERE t.root_id = o.id RETURNING t.id
), gone_events AS (
    -- task_events has no foreign key (see the model): its rows go with their tasks here.
    DELETE FROM task_events e USING gone g WHERE e.task_id = g.id
), gone_hooks AS (
    -- The outbox has no foreign key to tasks either (ix_webhook_outbox_root_id). A pending
    -- or dead event stays: it still goes out, or waits for a person to look at it.
    DELETE FROM webhook_outbox w USING old_roots o
    WHERE w.root_id = o.id AND w.status = 'delivered'
), gone_rootless_hooks AS (
    -- Fire rollups and test events belong to no tree: by their age.
    DELETE FROM webhook_outbox w
    WHERE w.root_id IS NULL AND w.status = 'delivered' AND w.delivered_at < :before
      AND CAST(:before AS timestamptz) IS NOT NULL
)
SELECT (SELECT count(*) FROM old_roots) AS trees, (SELECT count(*) FROM gone) AS tasks;

-- fire_insert_started --
-- Record the start of an orchestrator fire.
INSERT INTO fires (plan) VALUES (CAST(:plan AS jsonb)) RETURNING id, started_at;

-- fire_update_finished --
-- Record the end of a fire: its stats and rollup note, and its `fire.rollup` webhook
-- events in the same statement (a fire writes no task_events row, so the outbox trigger
-- does not see it). Fires carry no tenant: only endpoints without a tenant filter get them.
WITH upd AS (
    UPDATE fires
    SET finished_at = now(), plan = CAST(:plan AS jsonb), stats = CAST(:stats AS jsonb),
        rollup = :rollup
    WHERE id = :id
    RETURNING *
), hook AS (
    INSERT INTO webhook_outbox (endpoint, event, payload)
    SELECT w.name, 'fire.rollup',
           jsonb_build_object('event', 'fire.rollup', 'fire_id', u.id, 'rollup', u.rollup,
                              'stats', u.stats, 'started_at', u.started_at,
                              'finished_at', u.finished_at)
    FROM upd u JOIN webhook_endpoints w ON 'fire.rollup' = ANY(w.events) AND w.tenant IS NULL
    RETURNING 1
), wake AS (
    SELECT pg_notify('{webhooks_channel}', '') WHERE EXISTS (SELECT 1 FROM hook)
)
-- A CTE nobody reads is not run: the count makes the notify happen, the row stays the same.
SELECT upd.* FROM upd WHERE (SELECT count(*) FROM wake) >= 0;

-- fire_count_since --
-- How many fires started since :since (the daily cap).
SELECT count(*) FROM fires WHERE started_at >= :since;

-- fire_get_last --
-- The most recent fire.
SELECT * FROM fires ORDER BY started_at DESC LIMIT 1;

-- task_release_leased --
-- A worker shutting down hands back what it still holds: running tasks return to where
-- they were claimed from, judging tasks lose their lease. Guarded by the lease tokens.
WITH upd AS (
    UPDATE tasks t
    SET status = CASE WHEN t.status = 'judging' THEN 'judging'
                      WHEN t.phase = 'aggregate' THEN 'ready_to_aggregate'
                      ELSE 'pending' END,
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        delivery_count = GREATEST(t.delivery_count - 1, 0),
        updated_at = now()
    FROM unnest(CAST(:tokens AS uuid[])) AS k(token)  -- RETURNING names the token released
    WHERE t.lease_token = k.token
    RETURNING t.id, t.to_agent, t.status,
              CASE WHEN t.status = 'judging' THEN 'judging' ELSE 'running' END AS from_status,
              k.token
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail, lease_token)
    SELECT id, from_status, status, :worker, 'released by a worker shutting down', token
    FROM upd
), notify AS (
    SELECT pg_notify('{tasks_channel}', CASE WHEN s = 'judging' THEN 'judge' ELSE a END)
    FROM (SELECT DISTINCT status AS s, to_agent AS a FROM upd) d
)
SELECT id, (SELECT count(*) FROM notify) AS notified FROM upd;

-- model_call_list_tree --
-- Every model call made by any task of one tree, in the order they were made (replay files).
-- The tree's calls by their root_id index, each one's agent by a primary-key probe (a join
-- to the tree's tasks could be planned as a scan of every call when nothing is analyzed).
SELECT m.*, t.to_agent AS agent
FROM model_calls m
CROSS JOIN LATERAL (SELECT x.to_agent FROM tasks x WHERE x.id = m.task_id OFFSET 0) t
WHERE m.root_id = :root_id
ORDER BY m.id;

-- fire_lock_try --
-- Take the session-level advisory lock that lets one orchestrator fire run at a time
-- (across machines: the lock lives in the server). Held until unlocked or disconnected.
SELECT pg_try_advisory_lock(:key) AS locked;

-- fire_lock_release --
-- Release the fire's advisory lock (closing the connection releases it too).
SELECT pg_advisory_unlock(:key) AS unlocked;

-- session_lock_try --
-- Take a session-level advisory lock that elects one process for a job (the trace
-- exporter): held by this connection's session until unlocked or disconnected, so a
-- process that dies lets another take over. Taking it again on the same session is a
-- no-op that answers true (the lock is re-entrant).
SELECT pg_try_advisory_lock(:key) AS locked;

-- session_lock_release --
-- Release a lock taken by session_lock_try (closing the connection releases it too).
SELECT pg_advisory_unlock(:key) AS unlocked;

-- task_event_max_id --
-- The newest event id: a fire's watermark. Events written after the fire started have a
-- larger id (identity values only grow), so later scans are index range scans on the key.
SELECT COALESCE(max(id), 0) AS id FROM task_events;

-- task_event_count_by_worker --
-- Transitions written after event :after_id by workers whose id starts with one of
-- :prefixes (the fire's cross-check of what its workers reported), per kind. 'released'
-- marks hand-backs by a worker shutting down; 'aggregate' marks a running -> waiting
-- written in the aggregate phase (a parent retrying children, not a delegation).
SELECT e.worker, e.from_status, e.to_status,
       COALESCE(e.detail = 'released by a worker shutting down', false) AS released,
       COALESCE(c.detail LIKE 'claimed for aggregate%', false) AS aggregate,
       count(*) AS n
FROM task_events e
LEFT JOIN LATERAL (
    SELECT x.detail FROM task_events x
    WHERE x.task_id = e.task_id AND x.id < e.id AND x.to_status = 'running'
    ORDER BY x.id DESC LIMIT 1
) c ON e.from_status = 'running' AND e.to_status = 'waiting'
WHERE e.id > :after_id AND e.worker ^@ ANY(CAST(:prefixes AS text[]))
GROUP BY 1, 2, 3, 4, 5;

-- task_event_count_failures --
-- Tasks that ended failed or escalated after event :after_id at the hands of workers
-- whose id starts with one of :prefixes, grouped by status, agent and error text.
SELECT e.to_status AS status, t.to_agent AS agent, left(COALESCE(t.error, ''), 300) AS error,
       count(*) AS n
FROM task_events e JOIN tasks t ON t.id = e.task_id
WHERE e.id > :after_id AND e.to_status IN ('failed', 'escalated')
  AND e.worker ^@ ANY(CAST(:prefixes AS text[]))
GROUP BY 1, 2, 3
ORDER BY n DESC, 1, 2, 3
LIMIT :limit;

-- db_ping --
-- The cheapest statement that proves the database answers (health checks).
SELECT 1;

-- server_in_recovery --
-- Whether this server is a standby (replaying WAL): a LISTEN there would hear nothing,
-- since work is written on the primary. The listener asks after every (re)connection.
SELECT pg_is_in_recovery();

-- channel_listen_tasks --
-- Subscribe this connection to the task channel (a worker waits on it between claims).
LISTEN {tasks_channel};

-- migration_lock_acquire --
-- Serialise migrations: several processes may start at once on a fresh database; one migrates.
SELECT pg_advisory_lock(hashtext('orgchart:migrate'));

-- migration_lock_release --
-- Release the migration lock taken by migration_lock_acquire.
SELECT pg_advisory_unlock(hashtext('orgchart:migrate'));

-- migration_version_table_exists --
-- Whether Alembic's version table exists (NULL on an empty database).
SELECT to_regclass('alembic_version');

-- migration_version_get --
-- The database's Alembic revision.
SELECT version_num FROM alembic_version;

-- fragment_task_node_json --
-- One task as JSON text in the public shape (views.task_json), spliced into the tree
-- reads below as {fragment_task_node_json} over a row ``n`` of tasks, left open (no
-- closing brace: views.assemble_tree adds the children and closes it). Timestamps are
-- formatted as Python's isoformat() does, so both paths give equal JSON.
-- One concat() (a single pass: a chain of || copies the growing text at each step).
concat('{"id":"', n.id, '","root_id":"', n.root_id,
       '","parent_id":', COALESCE('"' || n.parent_id || '"', 'null'),
       ',"priority":', COALESCE(n.priority::text, 'null'),
       ',"spent_tokens":', n.spent_tokens, ',"spent_usd":"', n.spent_usd,
       '","own_tokens":', n.own_tokens, ',"own_usd":"', n.own_usd,
       '","duration_seconds":', round(n.duration_seconds * 1e6) / 1e6,
       ',"created_at":', COALESCE('"' || replace(to_char(n.created_at, 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM'), '.000000', '') || '"',
                'null'),
       ',"started_at":', COALESCE('"' || replace(to_char(n.started_at, 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM'), '.000000', '') || '"',
                'null'),
       ',"completed_at":', COALESCE('"' || replace(to_char(n.completed_at, 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM'), '.000000', '') || '"',
                'null'),
       ',"depth":', n.depth,
       ',"budget_tokens":', COALESCE(n.budget_tokens::text, 'null'),
       ',"budget_seconds":', COALESCE(n.budget_seconds::text, 'null'),
       ',"budget_usd":', COALESCE('"' || CASE WHEN n.budget_usd = trunc(n.budget_usd)
                                             THEN trunc(n.budget_usd)::text
                                             ELSE n.budget_usd::text END || '"', 'null'),
       ',"retry_count":', n.retry_count, ',"delivery_count":', n.delivery_count, ',',
       -- Text as to_json() escapes it, jsonb as its own text (a json_build_object
       -- built and cut here took 30 % of the read on a 10,000-task tree).
       '"agent":', to_json(n.to_agent), ',"type":', to_json(n.type),
       ',"status":', to_json(n.status),
       ',"tenant":', to_json(n.tenant),
       ',"payload":', COALESCE(n.payload::text, 'null'),
       ',"result":', COALESCE(n.result::text, 'null'),
       ',"error":', COALESCE(to_json(n.error)::text, 'null'),
       ',"verdict":', COALESCE(n.verdict::text, 'null'),
       ',"route":', COALESCE(to_json(n.route)::text, 'null'),
       ',"route_reason":', COALESCE(to_json(n.route_reason)::text, 'null'),
       ',"model":', COALESCE(to_json(n.model)::text, 'null'),
       ',"served_by":', {fragment_served_by_json},
       ',"cost_estimated":', CASE WHEN s.estimated THEN 'true' ELSE 'false' END,
       ',"from_agent":', COALESCE(to_json(n.from_agent)::text, 'null'),
       ',"key":', CASE WHEN n.parent_id IS NOT NULL
                       THEN COALESCE(to_json(n.idempotency_key)::text, 'null') ELSE 'null' END,
       ',"idempotency_key":', CASE WHEN n.parent_id IS NULL
                                   THEN COALESCE(to_json(n.idempotency_key)::text, 'null')
                                   ELSE 'null' END,
       ',"success_criteria":', COALESCE(n.success_criteria::text, 'null'),
       ',"kill_criteria":', COALESCE(n.kill_criteria::text, 'null'),
       ',"forked_from":', COALESCE('"' || n.forked_from || '"', 'null'),
       ',"fork":', COALESCE(n.fork::text, 'null'),
       ',"agent_version":', COALESCE(to_json(n.agent_version)::text, 'null'),
       ',"prompt_hashes":', COALESCE(n.prompt_hashes::text, 'null'))

-- fragment_subtree_ids --
-- The ids of the subtree under :under in tree :root_id, at most :depth levels below it
-- (``rel``: levels below :under), as the CTE ``sub``. Each level's children are found by
-- a lateral probe of the parent_id index per task (never a join planned on statistics).
WITH RECURSIVE sub AS (
    -- :under by its primary key, then checked to be in the tree (the fence keeps root_id's
    -- index out: on a fresh tree it looks like one row and would be scanned whole)
    SELECT u.id, 0 AS rel
    FROM (SELECT id, root_id FROM tasks WHERE id = CAST(:under AS uuid) OFFSET 0) u
    WHERE u.root_id = :root_id
    UNION ALL
    SELECT c.id, s.rel + 1 FROM sub s
    CROSS JOIN LATERAL (SELECT x.id FROM tasks x WHERE x.parent_id = s.id OFFSET 0) c
    WHERE s.rel < COALESCE(CAST(:depth AS integer), 2147483647)
)

-- fragment_node_totals --
-- The columns a tree read sums its totals from, after each node's JSON (``s``:
-- fragment_task_served; served_by as JSON text).
n.status, n.own_tokens, n.own_usd, n.duration_seconds, {fragment_served_by_json}, s.estimated

-- fragment_task_summary_json --
-- One task as JSON text in the tree's summary shape (GET /trees/{id}?fields=summary), left
-- open as fragment_task_node_json is: what
-- a tree view draws, without what agents write (payload, result, verdict, criteria: about
-- 1 KB a node in a real tree, most of a 10,000-task tree's bytes; GET /tasks/{id} reads
-- them for one task) and without timestamps (to_char was a third of this read's time):
-- ``goal`` (the payload's goal, at most 200 characters), ``has_result``, ``verdict_passed``
-- and ``verdict_score``; ``error`` is cut at 500 characters; ``forked_from`` (a fork's
-- branch: the task it re-runs). Formatted as
-- fragment_task_node_json formats the same fields.
concat('{"id":"', n.id, '","parent_id":', COALESCE('"' || n.parent_id || '"', 'null'),
       ',"agent":', to_json(n.to_agent), ',"type":', to_json(n.type),
       ',"status":', to_json(n.status), ',"depth":', n.depth,
       ',"tenant":', to_json(n.tenant),
       ',"spent_tokens":', n.spent_tokens, ',"spent_usd":"', n.spent_usd,
       '","own_tokens":', n.own_tokens, ',"own_usd":"', n.own_usd,
       '","duration_seconds":', round(n.duration_seconds * 1e6) / 1e6,
       ',"goal":', COALESCE(to_json(left(n.payload ->> 'goal', 200))::text, 'null'),
       ',"has_result":', CASE WHEN n.result IS NULL THEN 'false' ELSE 'true' END,
       ',"verdict_passed":', COALESCE((n.verdict -> 'passed')::text, 'null'),
       ',"verdict_score":', COALESCE((n.verdict -> 'score')::text, 'null'),
       ',"error":', COALESCE(to_json(left(n.error, 500))::text, 'null'),
       ',"route":', COALESCE(to_json(n.route)::text, 'null'),
       ',"model":', COALESCE(to_json(n.model)::text, 'null'),
       ',"served_by":', {fragment_served_by_json},
       ',"cost_estimated":', CASE WHEN s.estimated THEN 'true' ELSE 'false' END,
       ',"forked_from":', COALESCE('"' || n.forked_from || '"', 'null'))

-- fragment_task_served --
-- Which backends served one task's model calls, over a row ``n`` of tasks, as
-- a lateral join named ``s`` (CROSS JOIN LATERAL this fragment, for one task or every
-- task of a tree). Columns: ``served_by``, the task's calls per backend as JSON text
-- ({"ollama": 1, "offline": 1}: keys in jsonb's order, shorter first, as the jsonb it
-- was; a call answered from the record counts as "replay"; 'null' without calls), and ``estimated``: a charged call
-- was served by a backend that did not run the routed model (offline, or a replay of a
-- recorded run), so its cost is that model's configured price, an estimate (budgets count
-- it all the same; NULL without calls). One probe of the task's calls
-- (ix_model_calls_task_id_attempt), grouped by backend, and always exactly one row.
-- Why a probe per task and not one GROUP BY over the tree's calls joined to its tasks:
-- an aggregate cannot take the task as a parameter, so when PostgreSQL has no statistics
-- for a new tree's rows (it takes each side for one row) its only nested loop re-ran the
-- whole aggregate for every task: 51 million pairs and 3.5-5.3 s on a fresh 10,101-task
-- tree (PostgreSQL 15), against 0.2 s after ANALYZE. A lateral aggregate has no other
-- plan than this index probe, whatever the statistics.
-- One probe, not three: it was a min/max pass plus, for a task served by two backends
-- (an offline call and a real one), a jsonb_object_agg that read the calls again once per
-- use (the node's JSON and the totals' column): 3 probes and 12 buffers a task. Server
-- CPU of task_tree_nodes on a fresh 10,101-task tree, full/summary: 312/184 ms, now
-- 193/130 ms (PostgreSQL 15, a shared machine at load 5-7).
(SELECT bool_or(g.estimated) AS estimated,
        COALESCE('{' || string_agg(concat(to_json(g.served), ': ', g.calls), ', '
                                   ORDER BY octet_length(g.served), g.served COLLATE "C")
                 || '}', 'null') AS served_by
 FROM (SELECT CASE WHEN c.replayed THEN 'replay' ELSE c.backend END AS served,
              count(*) AS calls,
              bool_or(c.cost_usd > 0 AND c.backend IN ('offline', 'replay')) AS estimated
       FROM model_calls c WHERE c.task_id = n.id GROUP BY 1) g)

-- fragment_served_by_json --
-- A task's ``served_by`` as JSON text, from its row ``s`` of fragment_task_served.
s.served_by

-- fragment_tree_node_row --
-- One row of a tree read over a row ``n`` of tasks: the narrow keys the caller sorts by
-- (created_at as seconds since the epoch, a double: it sorts as the timestamp does, to
-- the microsecond; psycopg loads 10,000 of them in about 1 ms, timestamps in 5 ms),
-- the node as JSON text in the shape :summary asks for (fragment_task_summary_json, else
-- fragment_task_node_json: a parameter known when the statement is planned, so only one
-- is built; without its closing brace), then the totals' sources (fragment_node_totals).
n.id::text, n.parent_id::text, n.depth, date_part('epoch', n.created_at) AS created_at,
CASE WHEN CAST(:summary AS boolean) THEN {fragment_task_summary_json}
     ELSE {fragment_task_node_json} END AS node,
{fragment_node_totals}

-- task_tree_nodes --
-- A whole tree (at most :depth levels below the root) as JSON text built in the database,
-- one row per node (fragment_tree_node_row; :summary for the summary shape); only the
-- nodes of part :part of :parts (by the last byte of their id: a big tree is read in
-- parts on several connections at once, building the JSON is the cost and it splits).
-- Unordered: the caller sorts the narrow keys (an ORDER BY here would sort the wide text).
-- No join whose plan rests on statistics: one scan of the tree's tasks, then a lateral
-- probe per task (fragment_task_served says why), so a tree read just after it ends,
-- before any ANALYZE has seen its rows, is planned as it is afterwards.
SELECT {fragment_tree_node_row}
FROM tasks n CROSS JOIN LATERAL {fragment_task_served} s
WHERE n.root_id = :root_id AND n.depth <= COALESCE(CAST(:depth AS integer), 2147483647)
  AND get_byte(uuid_send(n.id), 15) % :parts = :part;

-- task_subtree_nodes --
-- The subtree under :under (at most :depth levels below it) in task_tree_nodes' rows.
-- Each task of ``sub`` is read by its primary key alone (a lateral probe, OFFSET 0 so it
-- is not flattened into a join; its descendants are in the tree): joined to the tree's
-- tasks, or filtered on root_id too, a fresh tree with no statistics was planned as a
-- scan of the whole tree per task of the subtree (1 million rows for 99 tasks).
{fragment_subtree_ids}
SELECT {fragment_tree_node_row}
FROM sub
CROSS JOIN LATERAL (SELECT * FROM tasks x WHERE x.id = sub.id OFFSET 0) n
CROSS JOIN LATERAL {fragment_task_served} s;

-- task_tree_size --
-- How many tasks a tree holds (an index-only count on root_id).
SELECT count(*) FROM tasks WHERE root_id = :root_id;

-- task_tree_changes --
-- The transitions of one tree's tasks after task_events id :after, oldest first, at most
-- :limit (pages and watchers follow a live tree by these instead of re-reading it).
-- Read per task of the tree on the (task_id, id) index: the cost follows the tree's size,
-- never the events table's, however old the cursor.
SELECT e.id, t.id AS task_id, e.from_status, e.to_status, e.at, e.worker, e.detail
FROM tasks t
CROSS JOIN LATERAL (
    SELECT x.id, x.from_status, x.to_status, x.at, x.worker, x.detail
    FROM task_events x WHERE x.task_id = t.id AND x.id > :after
    OFFSET 0  -- a fence: the planner must not flatten this into a join over the table
) e
WHERE t.root_id = :root_id
ORDER BY e.id
LIMIT :limit;

-- task_list_by_ids --
-- The current rows of the given tasks (the ones a change feed names), with which
-- backends served each one's calls (fragment_task_served).
SELECT n.*, CAST({fragment_served_by_json} AS jsonb) AS served_by,
       COALESCE(s.estimated, false) AS cost_estimated
FROM tasks n CROSS JOIN LATERAL {fragment_task_served} s
WHERE n.id = ANY(CAST(:ids AS uuid[])) ORDER BY n.depth, n.created_at, n.id;

-- metrics_live_tasks --
-- Unfinished tasks by status and agent, with the oldest claimable one's creation time.
-- Each live status is read through its own partial index (claimable, running, waiting,
-- unleased judging; leased judging among the leased): finished rows, however many, are
-- never read, and no index over all statuses is needed (migration 0020).
SELECT status, to_agent AS agent, count(*) AS n,
       min(created_at) FILTER (WHERE status IN ('pending', 'ready_to_aggregate')
                               AND available_at <= now()) AS oldest_claimable
FROM (
    SELECT status, to_agent, created_at, available_at FROM tasks
    WHERE status IN ('pending', 'ready_to_aggregate')
    UNION ALL
    SELECT status, to_agent, created_at, available_at FROM tasks WHERE status = 'running'
    UNION ALL
    SELECT status, to_agent, created_at, available_at FROM tasks WHERE status = 'waiting'
    UNION ALL
    SELECT status, to_agent, created_at, available_at FROM tasks
    WHERE status = 'judging' AND lease_token IS NULL
    UNION ALL
    SELECT status, to_agent, created_at, available_at FROM tasks
    WHERE lease_token IS NOT NULL AND status = 'judging'
) live
GROUP BY status, to_agent;

-- metrics_leases_by_owner --
-- Tasks leased (running, or being judged) per worker, from the leased-rows index.
SELECT lease_owner AS worker, status, count(*) AS n
FROM tasks WHERE lease_token IS NOT NULL
GROUP BY lease_owner, status;

-- metrics_cursors --
-- The newest task_events and model_calls ids (where a scraping process starts counting).
SELECT (SELECT COALESCE(max(id), 0) FROM task_events) AS event_id,
       (SELECT COALESCE(max(id), 0) FROM model_calls) AS call_id;

-- metrics_events_after --
-- Transitions after task_events id :after (at most :limit), by kind and agent, with how
-- many were the reaper's and poisonings; transitions to a final status also carry the
-- task's wall time (created_at to completed_at) as a histogram bucket of :bounds and a
-- sum of seconds. max_id is the new cursor.
WITH ev AS (
    SELECT e.id, e.task_id, e.from_status, e.to_status, e.worker, e.detail
    FROM task_events e WHERE e.id > :after ORDER BY e.id LIMIT :limit
), timed AS (
    SELECT ev.*, t.to_agent AS agent,
           CASE WHEN ev.to_status IN ('done', 'failed', 'escalated', 'cancelled')
                THEN EXTRACT(epoch FROM t.completed_at - t.created_at)::float8 END AS wall
    FROM ev LEFT JOIN tasks t ON t.id = ev.task_id
)
SELECT from_status, to_status, agent, width_bucket(wall, CAST(:bounds AS float8[])) AS bucket,
       count(*) AS n, count(*) FILTER (WHERE worker = 'reaper') AS reaped,
       count(*) FILTER (WHERE detail LIKE 'poison%') AS poisoned,
       COALESCE(sum(wall), 0) AS seconds, max(id) AS max_id
FROM timed GROUP BY from_status, to_status, agent, bucket;

-- metrics_model_calls_after --
-- Model calls after model_calls id :after (at most :limit) by route, model and latency
-- bucket (:bounds, seconds): calls, failed calls, tokens, cost; max_id is the new cursor.
WITH mc AS (
    SELECT id, route, model, duration_seconds, prompt_tokens, completion_tokens, cost_usd,
           error
    FROM model_calls WHERE id > :after ORDER BY id LIMIT :limit
)
SELECT route, model, width_bucket(duration_seconds, CAST(:bounds AS float8[])) AS bucket,
       count(*) AS n, count(*) FILTER (WHERE error IS NOT NULL) AS errors,
       sum(prompt_tokens) AS input_tokens, sum(completion_tokens) AS output_tokens,
       sum(cost_usd) AS cost_usd, sum(duration_seconds) AS seconds, max(id) AS max_id
FROM mc GROUP BY route, model, bucket;

-- export_cursor_open --
-- An exporter's cursor, read as it is, or created the first time: at the newest
-- task_events id (finished history is not exported), unless a tree begun within the
-- last :open_window_seconds is still open; then just before that tree's first event, so
-- the tasks it finished before this exporter started are sent with the rest of it. The
-- NOT EXISTS keeps the look at open roots (a scan of tasks) to the first time only.
WITH made AS (
    INSERT INTO export_cursors (name, last_event_id)
    SELECT :name, COALESCE(
        (SELECT min(e.id) - 1
         FROM tasks r JOIN task_events e ON e.task_id = r.id
         WHERE r.parent_id IS NULL
           AND r.status NOT IN ('done', 'failed', 'escalated')
           AND r.created_at > now() - make_interval(secs => :open_window_seconds)),
        (SELECT max(id) FROM task_events),
        0)
    WHERE NOT EXISTS (SELECT 1 FROM export_cursors WHERE name = :name)
    ON CONFLICT (name) DO NOTHING
    RETURNING last_event_id
)
SELECT last_event_id FROM made
UNION ALL
SELECT last_event_id FROM export_cursors WHERE name = :name
LIMIT 1;

-- export_cursor_advance --
-- Move an exporter's cursor forward (never back) once a batch up to :last_event_id is sent.
UPDATE export_cursors SET last_event_id = :last_event_id, updated_at = now()
WHERE name = :name AND last_event_id < :last_event_id;

-- trace_list_ended_after --
-- Tasks that reached a final status after task_events id :after, oldest first, at most
-- :limit, leaving out events younger than :settle_seconds (an event id is taken when the
-- row is written, so a younger one may still have a lower id uncommitted before it).
SELECT id, task_id FROM task_events
WHERE id > :after AND to_status IN ('done', 'failed', 'escalated', 'cancelled')
  AND at < clock_timestamp() - make_interval(secs => :settle_seconds)
ORDER BY id
LIMIT :limit;

-- trace_list_tasks --
-- The columns a trace span needs, for the given tasks.
SELECT id, parent_id, root_id, to_agent, type, status, depth, spent_tokens, spent_usd,
       own_tokens, own_usd, verdict, delivery_count, retry_count, route, model, error,
       created_at, started_at, completed_at
FROM tasks WHERE id = ANY(CAST(:ids AS uuid[]));

-- trace_list_events --
-- The transitions of the given tasks, oldest first (span events).
SELECT task_id, from_status, to_status, at, worker, detail
FROM task_events WHERE task_id = ANY(CAST(:ids AS uuid[])) ORDER BY task_id, id;

-- trace_list_model_calls --
-- The model calls of the given tasks without prompts or responses (child spans).
SELECT id, task_id, attempt, call_index, backend, route, model, prompt_tokens,
       completion_tokens, duration_seconds, cost_usd, error, created_at, replayed
FROM model_calls WHERE task_id = ANY(CAST(:ids AS uuid[])) ORDER BY task_id, id;

-- trace_list_tree_ids --
-- Every task id of one tree (to export or time a whole tree).
SELECT id FROM tasks WHERE root_id = :root_id;

-- timeline_tree --
-- One tree on a time axis, one row per task, seconds from the root's creation: start
-- (created), finish (completed, NULL while unfinished), resumed (the last time it left
-- 'waiting'), own (seconds in every phase but 'waiting'), queued (seconds pending or ready
-- to aggregate); and the task's JSON for the page, in integer milliseconds from the root's
-- creation: its phases ("segments": [kind, from, to], each lasting until the next
-- transition), its model calls ("calls": [from, to], or [from, to, 1] for a call
-- served from the record; a call's row is written when it returns, so it ends at
-- created_at) and its steps and tool calls ("tools": [from, to, name, status]; an
-- unfinished one lasts until now). date_part gives float8: cheaper than numeric.
-- Each task's events, calls and steps are aggregated in a lateral subquery over that
-- task's rows alone (the (task_id, ...) indexes), never aggregated per tree and joined
-- back: an aggregate cannot take the task as a parameter, so on a fresh tree that
-- PostgreSQL has no statistics for the join was planned as a nested loop re-reading
-- every task's calls for each task (51 million pairs, 4 s on 10,101 tasks).
WITH base AS (
    SELECT created_at AS t0, statement_timestamp() AS now FROM tasks WHERE id = :root_id
)
SELECT t.id::text AS id, t.parent_id::text AS parent_id, t.to_agent AS agent, t.status,
       t.depth, date_part('epoch', t.created_at - b.t0) AS start,
       date_part('epoch', t.completed_at - b.t0) AS finish,
       date_part('epoch', s.resumed - b.t0) AS resumed,
       COALESCE(s.own, 0) AS own, COALESCE(s.queued, 0) AS queued,
       date_part('epoch', b.now - b.t0) AS now, b.t0,
       '{"id":"' || t.id || '","parent_id":' || COALESCE('"' || t.parent_id || '"', 'null')
       || ',"agent":' || to_json(t.to_agent) || ',"status":"' || t.status
       || '","depth":' || t.depth
       || ',"start":' || round(date_part('epoch', t.created_at - b.t0) * 1000)::bigint
       || ',"end":' || round(date_part('epoch', COALESCE(t.completed_at, b.now) - b.t0)
                             * 1000)::bigint
       || ',"segments":[' || COALESCE(s.segments, '') || '],"calls":['
       || COALESCE(c.calls, '') || '],"tools":[' || COALESCE(x.tools, '') || ']}' AS json
FROM base b
CROSS JOIN tasks t
CROSS JOIN LATERAL (  -- the task's phases, from its events (each lasts until the next)
    SELECT string_agg('["' || ev.kind || '",'
                      || round(date_part('epoch', ev.at - b.t0) * 1000)::bigint || ','
                      || round(date_part('epoch', ev.until - b.t0) * 1000)::bigint || ']', ','
                      ORDER BY ev.id) FILTER (WHERE ev.kind IS NOT NULL AND ev.until > ev.at)
               AS segments,
           sum(date_part('epoch', ev.until - ev.at))
               FILTER (WHERE ev.kind <> 'waiting' AND ev.until > ev.at) AS own,
           sum(date_part('epoch', ev.until - ev.at))
               FILTER (WHERE ev.kind = 'queued' AND ev.until > ev.at) AS queued,
           max(ev.at) FILTER (WHERE ev.from_status = 'waiting' AND ev.to_status <> 'waiting')
               AS resumed
    FROM (SELECT e.id, e.from_status, e.to_status, e.at,
                 COALESCE(lead(e.at) OVER (ORDER BY e.id), t.completed_at, b.now) AS until,
                 CASE e.to_status WHEN 'pending' THEN 'queued'
                      WHEN 'ready_to_aggregate' THEN 'queued' WHEN 'running' THEN 'running'
                      WHEN 'waiting' THEN 'waiting' WHEN 'judging' THEN 'judging' END AS kind
          FROM task_events e WHERE e.task_id = t.id) ev
) s
CROSS JOIN LATERAL (  -- the task's model calls
    SELECT string_agg('['
                      || round((date_part('epoch', m.created_at - b.t0) - m.duration_seconds)
                               * 1000)::bigint
                      || ',' || round(date_part('epoch', m.created_at - b.t0) * 1000)::bigint
                      -- a call served from the record (a redelivery, a fork) ends in ,1
                      || CASE WHEN m.replayed THEN ',1' ELSE '' END
                      || ']', ',' ORDER BY m.id) AS calls
    FROM model_calls m WHERE m.task_id = t.id
) c
CROSS JOIN LATERAL (  -- the task's steps and tool calls
    SELECT string_agg('[' || round(date_part('epoch', st.started_at - b.t0) * 1000)::bigint
                      || ',' || round(date_part('epoch', COALESCE(st.finished_at, b.now) - b.t0)
                                      * 1000)::bigint
                      || ',' || to_json(st.name) || ',"' || st.status || '"]', ','
                      ORDER BY st.id) AS tools
    FROM task_steps st WHERE st.task_id = t.id
) x
WHERE t.root_id = :root_id;

-- ---------------------------------------------------------------- durable steps and tools
-- A step (ctx.step, or one tool call of a model's tool loop) is recorded 'started' before
-- its function runs and 'finished' or 'failed' after. Both writes are fenced by the
-- task's lease token: the task row is read FOR SHARE, so a reaper or watchdog that takes
-- the lease away either commits first (the step write then matches no row) or waits for
-- the write's commit. A step row is not a task transition, so no task_events row (like
-- model_calls).

-- task_step_begin --
-- Start one step of a leased task, or serve it from the record: returns the row, with
-- replayed = true when it was finished with the same arguments (nothing to run).
-- A row found 'started' or 'failed' (its worker died inside it, or it raised) starts
-- again: 'starts' counts it. Different arguments at the same place are a new step.
-- No row returned: the lease is gone.
-- Run alone (autocommit: one round trip), it commits without waiting for its WAL to
-- reach the disk (set_config(..., true): this transaction only): the 'started' row is a
-- marker ("it may have run"), not a result. The step's finish waits for the disk, and
-- WAL is flushed in order, so a step that ends has both rows durable; only a database
-- crash within a moment of the begin (the WAL writer flushes it within
-- 3 x wal_writer_delay) loses the marker of a step whose worker died in it too.
WITH me AS (
    SELECT id, root_id FROM tasks
    WHERE id = :task_id AND lease_token = :token
      AND set_config('synchronous_commit', 'off', true) IS NOT NULL
    FOR SHARE
), began AS (
    INSERT INTO task_steps AS s (task_id, root_id, phase, position, name, kind, status,
                                 args, args_hash, idempotency_key, tool_call_id, attempt)
    SELECT id, root_id, :phase, :position, :name, :kind, 'started', :args, :args_hash,
           :idempotency_key, :tool_call_id, :attempt
    FROM me
    ON CONFLICT (task_id, phase, position, name) DO UPDATE
    SET status = 'started', starts = s.starts + 1, attempt = EXCLUDED.attempt,
        args = EXCLUDED.args, args_hash = EXCLUDED.args_hash,
        idempotency_key = EXCLUDED.idempotency_key, tool_call_id = EXCLUDED.tool_call_id,
        result = NULL, error = NULL, tries = 0, started_at = clock_timestamp(),
        finished_at = NULL, duration_seconds = NULL
    WHERE NOT (s.status = 'finished' AND s.args_hash = EXCLUDED.args_hash)
    RETURNING s.id, s.status, s.starts, s.replays, s.result, s.error,
              s.idempotency_key, false AS replayed
), served AS (
    -- Same snapshot as 'began': exactly one of the two touches an existing row.
    UPDATE task_steps s SET replays = s.replays + 1
    FROM me
    WHERE s.task_id = me.id AND s.phase = :phase AND s.position = :position
      AND s.name = :name AND s.status = 'finished' AND s.args_hash = :args_hash
    RETURNING s.id, s.status, s.starts, s.replays, s.result, s.error,
              s.idempotency_key, true AS replayed
)
SELECT * FROM began UNION ALL SELECT * FROM served;

-- task_step_finish --
-- Record a started step's result ('finished') or error ('failed'), and charge its cost
-- (a tool's cost_usd) to the task's own spend, fenced by the lease token. No row
-- returned: the lease is gone (a late worker's result is not recorded, nor charged).
-- Committed durably (the server's synchronous_commit, 'on' by default): the recorded
-- result is what keeps the side effect from running again, also after a database crash.
-- Safe to repeat: when this start of the step is already recorded (the first attempt
-- committed, then its connection broke before the answer), its id is returned again and
-- nothing is charged twice.
WITH me AS (
    SELECT id FROM tasks
    WHERE id = :task_id AND lease_token = :token
    FOR SHARE
), done AS (
    UPDATE task_steps s
    SET status = :status, result = CAST(:result AS jsonb), error = :error, tries = :tries,
        cost_usd = CAST(:usd AS numeric), finished_at = clock_timestamp(),
        duration_seconds = :duration_seconds
    FROM me
    WHERE s.id = :step_id AND s.task_id = me.id AND s.status = 'started'
      AND s.starts = :starts
    RETURNING s.id
), charged AS (
    UPDATE tasks t
    SET own_usd = t.own_usd + CAST(:usd AS numeric),
        spent_usd = t.spent_usd + CAST(:usd AS numeric), updated_at = now()
    FROM me
    WHERE t.id = me.id AND CAST(:usd AS numeric) > 0 AND EXISTS (SELECT 1 FROM done)
    RETURNING t.id
)
SELECT id FROM done
UNION ALL
SELECT s.id FROM task_steps s JOIN me ON s.task_id = me.id
WHERE s.id = :step_id AND s.starts = :starts AND s.status = :status
  AND NOT EXISTS (SELECT 1 FROM done);

-- tool_approval_ask --
-- A tool call that requires a person's approval: the decision on exactly this call (the
-- task, phase, call id, tool and validated arguments' hash), or, when there is none, the
-- ask recorded now ('asked': the caller then holds the task). Fenced by the lease: no
-- row returned when it is gone. An ask for the same call id with another tool or other
-- arguments replaces the earlier one (a decision is on the call as it was shown).
WITH me AS (
    SELECT id FROM tasks WHERE id = :task_id AND lease_token = :token FOR SHARE
), asked AS (
    INSERT INTO tool_approvals AS a (task_id, phase, call_id, tool, args_hash, args, status)
    SELECT id, :phase, :call_id, :tool, :args_hash, :args, 'asked' FROM me
    ON CONFLICT (task_id, phase, call_id) DO UPDATE
    SET tool = EXCLUDED.tool, args_hash = EXCLUDED.args_hash, args = EXCLUDED.args,
        status = 'asked', asked_at = now(), decided_at = NULL, decided_by = NULL,
        note = NULL
    WHERE a.tool <> EXCLUDED.tool OR a.args_hash <> EXCLUDED.args_hash
    RETURNING a.status
)
SELECT status FROM asked
UNION ALL
SELECT a.status FROM tool_approvals a JOIN me ON a.task_id = me.id
WHERE a.phase = :phase AND a.call_id = :call_id AND a.tool = :tool
  AND a.args_hash = :args_hash;

-- tool_approval_list --
-- The asks and decisions on one task's tool calls.
SELECT * FROM tool_approvals WHERE task_id = :id ORDER BY asked_at, call_id;

-- task_list_steps --
-- The steps and tool calls of one task, in the order they first started.
SELECT * FROM task_steps WHERE task_id = :id ORDER BY id;

-- step_list_by_tasks --
-- The steps of the given tasks without their results (trace spans, waterfall segments).
SELECT id, task_id, phase, position, name, kind, status, tool_call_id, error, starts,
       replays, cost_usd, started_at, finished_at, duration_seconds
FROM task_steps WHERE task_id = ANY(CAST(:ids AS uuid[])) ORDER BY task_id, id;

-- ===================================================================================
-- Steering (issue 22): a person's hand on a running tree. Cancel a subtree, pause and
-- resume a tree, answer a question to the built-in agent 'human', approve or reject a
-- task held by the require_approval policy. Each change is one guarded statement with
-- its events; fan-in of a parent whose child ended here runs in the same transaction
-- (runtime/store/steering.py), as for a child finished by a worker.
-- ===================================================================================

-- task_cancel_subtree --
-- Cancel :id and every open task below it, one event each; clears leases, so every fenced
-- write of a worker still holding one (finish, delegate, retry, judge) matches nothing.
-- The subtree is walked down parent_id (ix_tasks_parent_id_status). Rows are locked
-- deepest first, then by id: a finishing child locks itself, then its parent, so the
-- cancel takes rows in the same order and the two do not deadlock. A row a worker
-- finished while the cancel waited for its lock is re-checked after the wait and left
-- alone when no longer open. The caller holds the tree's steering lock (tree_lock_steer),
-- which delegations and retries of children hold shared, so no child appears under this
-- statement while it runs (found in a later pass, after its parent, it would be locked
-- out of order). The caller still repeats it (in the same transaction) until it cancels
-- nothing: a person may reopen a task meanwhile. NOTIFY 'cancel' wakes the workers.
WITH RECURSIVE sub AS (
    SELECT id FROM tasks WHERE id = :id
    UNION ALL
    SELECT c.id FROM tasks c JOIN sub s ON c.parent_id = s.id
), locked AS (
    SELECT t.id, t.status, t.lease_owner
    FROM tasks t JOIN sub s ON s.id = t.id
    WHERE t.status IN ('pending', 'running', 'waiting', 'ready_to_aggregate', 'judging',
                       'awaiting_approval')
    ORDER BY t.depth DESC, t.id
    FOR UPDATE OF t
), upd AS (
    UPDATE tasks t
    SET status = 'cancelled',
        error = :error,
        lease_owner = NULL,
        lease_token = NULL,
        lease_expires_at = NULL,
        -- The run's time so far, for a task cancelled while running (COALESCE: a row
        -- claimed while the cancel waited for it can pair an old claimed_at with the new
        -- status in this statement's join; never write a NULL duration).
        duration_seconds = t.duration_seconds
            + COALESCE(CASE WHEN t.status = 'running'
                            THEN extract(epoch FROM clock_timestamp() - t.claimed_at)
                            END, 0),
        completed_at = now(),
        updated_at = now()
    FROM locked l
    -- The status as locked (l), not as this statement's snapshot saw it: a row a worker
    -- moved on (waiting -> ready_to_aggregate) while the cancel waited is still open.
    WHERE t.id = l.id
      AND t.status IN ('pending', 'running', 'waiting', 'ready_to_aggregate', 'judging',
                       'awaiting_approval')
    RETURNING t.id, t.parent_id, t.depth, l.status AS from_status, l.lease_owner
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, from_status, 'cancelled', :actor,
           CASE WHEN id = :id THEN :detail ELSE :detail || ' (subtree of ' || :id || ')' END
    FROM upd
), notify AS (
    SELECT pg_notify('{tasks_channel}', 'cancel') WHERE EXISTS (SELECT 1 FROM upd)
)
SELECT id, parent_id, depth, from_status, lease_owner,
       (SELECT count(*) FROM notify) AS notified
FROM upd;

-- tree_pause_insert --
-- Pause a tree: one row for its root (a root only); pausing a paused tree inserts nothing.
-- NOTIFY 'pause' makes the workers' model-call gates read again (a read in flight may
-- predate the pause); nothing depends on it: every call reads the pause before it starts.
WITH ins AS (
    INSERT INTO tree_pauses (root_id, paused_by, note)
    SELECT id, :actor, :note FROM tasks WHERE id = :root_id AND parent_id IS NULL
    ON CONFLICT (root_id) DO NOTHING
    RETURNING root_id, paused_at
), notify AS (
    SELECT pg_notify('{tasks_channel}', 'pause') FROM ins
)
SELECT root_id, paused_at, (SELECT count(*) FROM notify) AS notified FROM ins;

-- tree_pause_delete --
-- Resume a tree: delete its pause, move the deadlines of its running tasks on by the time
-- it was paused (a paused task is not timed out for a person's pause), and wake the
-- workers of its claimable work.
WITH gone AS (
    DELETE FROM tree_pauses WHERE root_id = :root_id RETURNING root_id, paused_at
), shifted AS (
    UPDATE tasks t
    SET deadline_at = t.deadline_at + (now() - g.paused_at)
    FROM gone g
    WHERE t.root_id = g.root_id AND t.status = 'running'
    RETURNING t.id
), notify AS (
    SELECT pg_notify('{tasks_channel}', CASE WHEN s = 'judging' THEN 'judge' ELSE a END)
    FROM (SELECT DISTINCT t.status AS s, t.to_agent AS a
          FROM tasks t JOIN gone g ON t.root_id = g.root_id
          WHERE t.status IN ('pending', 'ready_to_aggregate', 'judging')) d
)
SELECT g.root_id, g.paused_at, (SELECT count(*) FROM shifted) AS shifted,
       (SELECT count(*) FROM notify) AS notified
FROM gone g;

-- tree_pause_get --
-- The pause of one tree, if it is paused.
SELECT root_id, paused_at, paused_by, note FROM tree_pauses WHERE root_id = :root_id;

-- task_gate_calls --
-- The model-call gate: for the given tasks, whether each may start a model call now
-- (open and in an unpaused tree) and who holds it (the lease token: a caller whose token
-- is not this one was taken away). One batched read per wave of calls, on primary keys.
SELECT t.id, t.status, (z.root_id IS NOT NULL) AS paused, t.lease_token
FROM tasks t LEFT JOIN tree_pauses z ON z.root_id = t.root_id
WHERE t.id = ANY(CAST(:ids AS uuid[]));

-- tree_lock_steer --
-- A cancel or a pause takes its tree's steering lock (exclusive, until it commits): it
-- waits for the model-call gate reads holding the lock shared (each held until its calls
-- have started), and the reads that come after wait for it. So no call that starts after
-- the command committed was let through by a read that could not see it.
SELECT pg_advisory_xact_lock(:lock_class, hashtext(CAST(:root_id AS text)));

-- tree_lock_steer_shared --
-- Hold the steering locks of the trees of the given tasks, shared, in key order (see
-- tree_lock_steer): the model-call gate, before its read; a delegation and a retry of
-- children, before any row (a cancel then never runs while they add or reopen tasks).
SELECT count(*) FROM (
    SELECT pg_advisory_xact_lock_shared(:lock_class, k)
    FROM (SELECT DISTINCT hashtext(CAST(root_id AS text)) AS k FROM tasks
          WHERE id = ANY(CAST(:ids AS uuid[])) ORDER BY 1) keys
) locked;

-- task_approve_awaiting --
-- A person approves a task held by require_approval or by a tool call that requires
-- approval: it becomes claimable, and the asks of its tool calls are approved. Guarded by
-- status = 'awaiting_approval', so an approval is used once (a second one changes nothing).
WITH upd AS (
    UPDATE tasks
    SET status = 'pending', available_at = now(), updated_at = now()
    WHERE id = :id AND status = 'awaiting_approval'
    RETURNING id, to_agent
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'awaiting_approval', 'pending', :actor, :detail FROM upd
), decided AS (  -- the tool calls the task was held for (tool_approval_ask)
    UPDATE tool_approvals a
    SET status = 'approved', decided_at = now(), decided_by = :actor, note = :detail
    FROM upd WHERE a.task_id = upd.id AND a.status = 'asked'
), notify AS (
    SELECT pg_notify('{tasks_channel}', to_agent) FROM upd
)
SELECT id, (SELECT count(*) FROM notify) AS notified FROM upd;

-- task_reject_awaiting --
-- A person rejects a held task: it ends failed with the note (its parent's fan-in follows
-- in the same transaction), and the asks of its tool calls are denied. Guarded by
-- status = 'awaiting_approval'.
WITH upd AS (
    UPDATE tasks
    SET status = 'failed', error = :error, completed_at = now(), updated_at = now()
    WHERE id = :id AND status = 'awaiting_approval'
    RETURNING id, parent_id
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'awaiting_approval', 'failed', :actor, :detail FROM upd
), decided AS (  -- the tool calls the task was held for (tool_approval_ask)
    UPDATE tool_approvals a
    SET status = 'denied', decided_at = now(), decided_by = :actor, note = :detail
    FROM upd WHERE a.task_id = upd.id AND a.status = 'asked'
)
SELECT id, parent_id FROM upd;

-- task_answer_question --
-- A person answers a question to 'human': the answer is its result and it ends done (the
-- parent's fan-in follows in the same transaction). Guarded by the status, so an answer
-- racing a cancel, a deadline or another answer changes nothing when it comes second.
WITH upd AS (
    UPDATE tasks
    SET status = 'done', result = CAST(:answer AS jsonb), error = NULL,
        started_at = COALESCE(started_at, created_at), completed_at = now(),
        updated_at = now()
    WHERE id = :id AND status = 'pending' AND to_agent = 'human'
    RETURNING id, parent_id
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'pending', 'done', :actor, :detail FROM upd
)
SELECT id, parent_id FROM upd;

-- task_fail_unanswered --
-- A question nobody answered within its budget_seconds (its deadline) ends failed with
-- 'no answer: deadline'; its parent decides, as for any failed child. Reads ix_tasks_inbox.
WITH late AS (
    SELECT id FROM tasks
    WHERE (status = 'awaiting_approval' OR (status = 'pending' AND to_agent = 'human'))
      AND status = 'pending' AND to_agent = 'human'
      AND created_at + make_interval(secs => COALESCE(budget_seconds, 300)) < now()
    ORDER BY created_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE tasks t
    SET status = 'failed', error = 'no answer: deadline', completed_at = now(),
        updated_at = now()
    FROM late l
    WHERE t.id = l.id  -- late's lock re-checked the status on the latest version
    RETURNING t.id, t.parent_id, t.budget_seconds
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, 'pending', 'failed', :worker,
           'no answer within budget_seconds = ' || COALESCE(budget_seconds, 300)
    FROM upd
)
SELECT id, parent_id FROM upd;

-- task_list_inbox --
-- What waits for a person, oldest first: questions to 'human' and tasks held for approval
-- (ix_tasks_inbox), then escalations; with the root's goal and the age in seconds.
SELECT kind, t.id, t.root_id, t.parent_id, t.from_agent, t.to_agent, t.type, t.payload,
       t.error, t.budget_seconds, t.created_at, r.payload AS root_payload,
       extract(epoch FROM now() - since) AS age_seconds
FROM (
    SELECT CASE WHEN status = 'awaiting_approval' THEN 'approval' ELSE 'question' END AS kind,
           id, created_at AS since
    FROM tasks
    WHERE status = 'awaiting_approval' OR (status = 'pending' AND to_agent = 'human')
    UNION ALL
    SELECT 'escalation', id, COALESCE(completed_at, created_at)
    FROM tasks WHERE status = 'escalated'
) w
JOIN tasks t ON t.id = w.id
JOIN tasks r ON r.id = t.root_id
ORDER BY since, t.id;

-- task_count_inbox_older --
-- Questions and approvals waiting longer than :seconds (the doctor's inbox alert).
SELECT count(*) FILTER (WHERE status = 'pending') AS questions,
       count(*) FILTER (WHERE status = 'awaiting_approval') AS approvals,
       min(created_at) AS oldest
FROM tasks
WHERE (status = 'awaiting_approval' OR (status = 'pending' AND to_agent = 'human'))
  AND created_at < now() - make_interval(secs => :seconds);
-- ---------------------------------------------------------------------- forks
-- A fork (docs/writing-agents.md, "Tuning a tree"): a branch is a new tree that re-runs
-- an original tree from its root. Every model call of a branch task that asks exactly
-- what its counterpart asked is served from the counterpart's record, charged zero.
-- These statements only read the original tree: it is never written.

-- task_insert_fork_root --
-- Insert a branch's root (root_id = id, forked_from = the original root) and its event;
-- held for approval by fragment_root_status.
WITH ins AS (
    INSERT INTO tasks (id, root_id, from_agent, to_agent, type, hypothesis_id, payload,
                       success_criteria, kill_criteria, budget_tokens, budget_seconds,
                       budget_usd, priority, depth, forked_from, fork, model_override, tenant,
                       agent_map, status)
    SELECT :id, :id, :from_agent, to_agent, :type, :hypothesis_id, CAST(:payload AS jsonb),
           CAST(:success_criteria AS jsonb), CAST(:kill_criteria AS jsonb), :budget_tokens,
           :budget_seconds, :budget_usd, :priority, 0, :forked_from, CAST(:fork AS jsonb),
           :model_override, :tenant, CAST(:agent_map AS jsonb), {fragment_root_status}
    FROM (VALUES (CAST(:to_agent AS text))) AS v(to_agent)
    RETURNING *
), ev AS (
    INSERT INTO task_events (task_id, from_status, to_status, worker, detail)
    SELECT id, NULL, status, :actor, :detail || {fragment_root_event_detail} FROM ins
), notify AS (
    SELECT pg_notify('{tasks_channel}', to_agent) FROM ins WHERE status = 'pending'
)
SELECT ins.*, (SELECT count(*) FROM notify) AS notified FROM ins;

-- model_call_get_recorded_many --
-- The recorded replies of a batch of durable calls (one JSON array: n, task_id,
-- counterpart, phase, position, hashes), one row per call that has one: the newest
-- successful reply made by a real request at the task's phase, position and request
-- (one of the hashes). A fork's branch task (with a counterpart) looks in its own
-- record first (a redelivery), else in its counterpart's, whose replayed rows count too
-- (they hold the reply they were served: a branch of a branch replays through the
-- branch in between). A thousand calls replayed at once (a re-run) are one statement,
-- not a thousand.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb))
        AS i(n int, task_id uuid, counterpart uuid, phase text, position text, hashes text[])
)
SELECT i.n, m.id, m.request_hash, m.response, m.thinking, m.model, m.route, m.backend,
       m.prompt_tokens, m.completion_tokens, m.tool_calls
FROM input i
CROSS JOIN LATERAL (
    SELECT * FROM model_calls c
    WHERE c.task_id IN (i.task_id, i.counterpart) AND c.phase = i.phase
      AND c.position = i.position AND c.request_hash = ANY(i.hashes)
      AND c.error IS NULL AND c.response IS NOT NULL
      AND (c.task_id = i.counterpart OR NOT c.replayed)
    ORDER BY c.task_id = i.task_id DESC, c.id DESC
    LIMIT 1
) m;

-- model_call_count_by_task --
-- Per task of one tree, the requests paid for and the calls served from the record.
SELECT task_id, count(*) FILTER (WHERE NOT replayed) AS paid,
       count(*) FILTER (WHERE replayed) AS replayed
FROM model_calls WHERE root_id = :root_id
GROUP BY task_id;

-- task_list_forks_of_root --
-- The branches forked from one root, oldest first.
SELECT id, status, to_agent, fork, created_at, completed_at
FROM tasks WHERE forked_from = :root_id AND parent_id IS NULL
ORDER BY created_at;

-- tenant_bucket_take --
-- Take :need tokens from a tenant's bucket ([tenants.<name>] tokens_per_minute = :rate),
-- after adding :refund (what settled calls reserved and did not spend; negative when they
-- spent more). The bucket is refilled first, lazily: the time since refilled_at times
-- :rate / 60, never above :rate (one minute's worth: a dead worker's reservation that was
-- never settled is simply spent, and nothing piles up while nobody calls). Nothing is
-- taken when the refilled bucket holds fewer than :need (the caller waits, then asks
-- again). The row is locked first (FOR UPDATE re-reads it after a wait): two workers'
-- takes queue on it and the second refills from the first's result. statement_timestamp()
-- and GREATEST keep a take that waited from refilling twice. Returns nothing when the
-- tenant has no bucket yet (tenant_bucket_create, then again).
WITH old AS (
    SELECT tenant,
           LEAST(CAST(:rate AS float8),
                 tokens + CAST(:rate AS float8) / 60.0
                          * GREATEST(0, extract(epoch FROM statement_timestamp() - refilled_at))
                 + CAST(:refund AS float8)) AS avail
    FROM tenant_buckets
    WHERE tenant = :tenant
    FOR UPDATE
)
UPDATE tenant_buckets b
SET tokens = o.avail - CASE WHEN o.avail >= CAST(:need AS float8)
                            THEN CAST(:need AS float8) ELSE 0 END,
    refilled_at = GREATEST(b.refilled_at, statement_timestamp())
FROM old o
WHERE b.tenant = o.tenant
RETURNING o.avail >= CAST(:need AS float8) AS taken, o.avail;

-- tenant_bucket_create --
-- A tenant's first bucket, full (one minute's worth); a concurrent creation wins, quietly.
INSERT INTO tenant_buckets (tenant, tokens, refilled_at)
VALUES (:tenant, CAST(:rate AS float8), statement_timestamp())
ON CONFLICT (tenant) DO NOTHING;

-- task_step_from_counterpart --
-- A fork's branch task (runtime.llm.ledger.BranchSteps) about to start a step: when its
-- counterpart finished the same step (phase, position, name) with the same arguments
-- (args_hash), the branch's row is recorded finished with that result, without running
-- (starts 0, replays 1), fenced by the lease token. No row returned: no such record, a
-- row of the branch's own is already there (task_step_begin decides then), or the lease
-- is gone.
WITH me AS (
    SELECT id, root_id FROM tasks
    WHERE id = :task_id AND lease_token = :token
    FOR SHARE
), src AS (
    SELECT result FROM task_steps
    WHERE task_id = :counterpart AND phase = :phase AND position = :position
      AND name = :name AND status = 'finished' AND args_hash = :args_hash
)
INSERT INTO task_steps AS s (task_id, root_id, phase, position, name, kind, status, args,
                             args_hash, idempotency_key, tool_call_id, attempt, result,
                             starts, replays, tries, finished_at, duration_seconds)
SELECT me.id, me.root_id, :phase, :position, :name, :kind, 'finished', :args, :args_hash,
       :idempotency_key, :tool_call_id, :attempt, src.result, 0, 1, 0, clock_timestamp(), 0
FROM me CROSS JOIN src
ON CONFLICT (task_id, phase, position, name) DO NOTHING
RETURNING s.id, s.status, s.starts, s.replays, s.result, s.error, s.idempotency_key,
          true AS replayed;

-- task_step_finished_at --
-- Whether a task finished the step at (phase, position, name) with these arguments: a
-- fork's branch task needs no approval for a tool call its counterpart finished (it is
-- served from that record, runtime.llm.ledger.BranchSteps). By task_steps' unique key.
SELECT 1 FROM task_steps
WHERE task_id = :task_id AND phase = :phase AND position = :position AND name = :name
  AND status = 'finished' AND args_hash = :args_hash;

-- tenant_buckets_dry --
-- Of the tenants with [tenants.<name>] tokens_per_minute (:bucket_tenants, :bucket_rates),
-- those whose bucket, refilled to now, holds less than one second's refill: the claim
-- leaves their tasks here (a claimed one would only wait in a worker for tokens, holding
-- its room) until it fills. Read before a claim only when some tenant has a limit.
SELECT b.tenant
FROM tenant_buckets b
JOIN unnest(CAST(:bucket_tenants AS text[]), CAST(:bucket_rates AS float8[])) AS r(tenant, rate)
    ON r.tenant = b.tenant
WHERE b.tokens + r.rate / 60.0 * (extract(epoch FROM now() - b.refilled_at) - 1) < 0;

-- ---------------------------------------------------------------------- experiments
-- Experiments (runtime/experiments, docs/experiments.md): a dataset's cases run under
-- named variants. Each tree's run row is written in the transaction that inserts its root,
-- so a resumed run finds every tree it started and never starts one twice.

-- dataset_insert --
-- Store a dataset version (name + content hash) unless it is already there; return its id.
WITH ins AS (
    INSERT INTO datasets (name, version, cases, source)
    VALUES (:dataset_name, :version, :cases, :source)
    ON CONFLICT (name, version) DO NOTHING
    RETURNING id, true AS created
)
SELECT id, created FROM ins
UNION ALL
SELECT id, false FROM datasets
WHERE name = :dataset_name AND version = :version AND NOT EXISTS (SELECT 1 FROM ins);

-- dataset_case_insert_many --
-- A new dataset version's cases, in order (one JSON array).
INSERT INTO dataset_cases (dataset_id, position, body)
SELECT :dataset_id, c.ordinality - 1, c.value
FROM jsonb_array_elements(CAST(:cases AS jsonb)) WITH ORDINALITY AS c(value, ordinality)
ON CONFLICT DO NOTHING;

-- dataset_get_latest --
-- A dataset by name: its newest version (or the version named).
SELECT id, name, version, cases, source, created_at
FROM datasets
WHERE name = :dataset_name AND (CAST(:version AS text) IS NULL OR version = :version)
ORDER BY created_at DESC, id
LIMIT 1;

-- dataset_list --
-- Every dataset version, newest first.
SELECT id, name, version, cases, source, created_at FROM datasets
ORDER BY name, created_at DESC;

-- dataset_case_list --
-- A dataset's cases in order.
SELECT position, body FROM dataset_cases WHERE dataset_id = :dataset_id ORDER BY position;

-- experiment_insert --
-- A new experiment (a name is used once); returns nothing when the name is taken.
INSERT INTO experiments (name, dataset_id, variants, repeat, budget_usd, tenant,
                         agents_modules)
VALUES (:experiment_name, :dataset_id, CAST(:variants AS jsonb), :repeat, :budget_usd, :tenant,
        CAST(:agents_modules AS jsonb))
ON CONFLICT (name) DO NOTHING
RETURNING *;

-- experiment_get --
-- One experiment by name or id, with its dataset's name and version.
SELECT e.*, d.name AS dataset_name, d.version AS dataset_version
FROM experiments e JOIN datasets d ON d.id = e.dataset_id
WHERE e.name = :key OR e.id::text = :key;

-- experiment_list --
-- Every experiment, newest first.
SELECT e.id, e.name, e.status, e.repeat, e.created_at, e.finished_at,
       d.name AS dataset_name, d.version AS dataset_version,
       (SELECT count(*) FROM experiment_runs r WHERE r.experiment_id = e.id) AS trees
FROM experiments e JOIN datasets d ON d.id = e.dataset_id
ORDER BY e.created_at DESC;

-- experiment_set_status --
-- An experiment finished or stopped (budget, a person), with a note.
UPDATE experiments
SET status = :status, note = COALESCE(:note, note),
    finished_at = CASE WHEN :status = 'running' THEN NULL ELSE now() END
WHERE id = :id
RETURNING id, status;

-- experiment_run_insert --
-- The run row of a tree whose root was just inserted in this transaction. Nothing comes back
-- when another process recorded this (case, variant, repetition) first: the caller rolls
-- its root back and uses the one recorded.
INSERT INTO experiment_runs (experiment_id, position, variant, repetition, root_id)
VALUES (:experiment_id, :position, :variant, :repetition, :root_id)
ON CONFLICT DO NOTHING
RETURNING root_id;

-- experiment_run_get --
-- The tree recorded for one (case, variant, repetition), if any.
SELECT root_id FROM experiment_runs
WHERE experiment_id = :experiment_id AND position = :position AND variant = :variant
  AND repetition = :repetition;

-- experiment_run_list --
-- An experiment's trees with what the report needs of each: the root's outcome and times,
-- its calls paid and replayed. A replayed call is charged zero: what it would have cost is
-- read from the record it was served from (the counterpart's row, or the task's own on a
-- redelivery), so a variant's cost can be told standing alone.
SELECT r.position, r.variant, r.repetition, r.root_id, t.status, t.result, t.error,
       t.verdict, t.created_at, t.completed_at,
       COALESCE(c.paid, 0) AS paid_calls, COALESCE(c.replayed, 0) AS replayed_calls,
       COALESCE(c.cost, 0) AS cost_usd, COALESCE(c.tokens, 0) AS tokens,
       COALESCE(c.replayed_cost, 0) AS replayed_cost_usd,
       COALESCE(c.replayed_tokens, 0) AS replayed_tokens
FROM experiment_runs r
JOIN tasks t ON t.id = r.root_id
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE NOT m.replayed) AS paid,
           count(*) FILTER (WHERE m.replayed) AS replayed,
           sum(m.cost_usd) AS cost,
           sum(m.prompt_tokens + m.completion_tokens) FILTER (WHERE NOT m.replayed) AS tokens,
           sum(src.cost_usd) AS replayed_cost,
           sum(src.prompt_tokens + src.completion_tokens) AS replayed_tokens
    FROM model_calls m
    LEFT JOIN tasks bt ON m.replayed AND bt.id = m.task_id
    LEFT JOIN LATERAL (
        SELECT o.cost_usd, o.prompt_tokens, o.completion_tokens
        FROM model_calls o
        WHERE m.replayed AND o.task_id IN (m.task_id, bt.forked_from)
          AND o.phase = m.phase AND o.position = m.position
          AND o.request_hash = m.request_hash AND NOT o.replayed AND o.error IS NULL
        ORDER BY o.id DESC LIMIT 1
    ) src ON true
    WHERE m.root_id = r.root_id
) c ON true
WHERE r.experiment_id = :experiment_id
ORDER BY r.position, r.variant, r.repetition;

-- experiment_task_replayed_seconds --
-- Every task of an experiment's trees with its parent and the time its replayed calls took
-- when they were made: each call served from the counterpart's record (the task it was
-- forked from, another tree) counts that record's duration_seconds. A call replayed from
-- the task's own record (a redelivery) counts nothing: its time is in this tree's wall
-- time already. The report folds these along the tree (a task's own, then its slowest
-- child: siblings run side by side), so a replayed variant's latency is not ~0.
SELECT t.root_id, t.id, t.parent_id, COALESCE(sum(src.duration_seconds), 0) AS replayed_seconds
FROM experiment_runs r
JOIN tasks t ON t.root_id = r.root_id
LEFT JOIN model_calls m ON m.task_id = t.id AND m.replayed AND t.forked_from IS NOT NULL
LEFT JOIN LATERAL (
    SELECT o.duration_seconds
    FROM model_calls o
    WHERE o.task_id = t.forked_from
      AND o.phase = m.phase AND o.position = m.position
      AND o.request_hash = m.request_hash AND NOT o.replayed AND o.error IS NULL
    ORDER BY o.id DESC LIMIT 1
) src ON true
WHERE r.experiment_id = :experiment_id
GROUP BY t.root_id, t.id, t.parent_id;

-- experiment_run_list_open --
-- The roots of an experiment's trees that have not ended (the runner waits on these).
SELECT r.root_id
FROM experiment_runs r JOIN tasks t ON t.id = r.root_id
WHERE r.experiment_id = :experiment_id
  AND t.status NOT IN ('done', 'failed', 'escalated', 'cancelled');

-- experiment_spend --
-- What an experiment's trees have paid so far (their model calls), live.
SELECT COALESCE(sum(m.cost_usd), 0) AS spent
FROM experiment_runs r JOIN model_calls m ON m.root_id = r.root_id
WHERE r.experiment_id = :experiment_id;

-- experiment_score_upsert_many --
-- Scores of runs (one JSON array); a rescore with the same scorer replaces its values.
INSERT INTO experiment_scores AS s (experiment_id, position, variant, repetition, scorer,
                                    value, explanation)
SELECT :experiment_id, x.position, x.variant, x.repetition, x.scorer, x.value, x.explanation
FROM jsonb_to_recordset(CAST(:scores AS jsonb))
     AS x(position int, variant text, repetition int, scorer text, value float8,
          explanation text)
ON CONFLICT (experiment_id, position, variant, repetition, scorer)
DO UPDATE SET value = excluded.value, explanation = excluded.explanation,
              created_at = now();

-- experiment_score_list --
-- An experiment's scores.
SELECT position, variant, repetition, scorer, value, explanation
FROM experiment_scores WHERE experiment_id = :experiment_id
ORDER BY scorer, position, variant, repetition;

-- experiment_delete --
-- Remove an experiment with its runs and scores (its trees stay unless pruned apart).
DELETE FROM experiments WHERE id = :id RETURNING id;

-- schedule_run_set_fire --
-- Name the fires row a fire schedule's slot started (inserted just after the slot's row,
-- in the same transaction).
UPDATE schedule_runs SET fire_id = :fire_id
WHERE schedule_id = :schedule_id AND slot_at = :slot_at;

-- ===================================================================================
-- Audit (issue 40, runtime/audit/): the checker reads a tree's facts in bounded
-- batches, each batch in one READ ONLY, REPEATABLE READ transaction (one snapshot, so a
-- task's status and its events agree), keyset-paged by id. Nothing here writes.
-- ===================================================================================

-- audit_begin_read_only --
-- Make the audit's transaction read-only with one snapshot (first statement of it).
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- audit_roots_page --
-- The next page of root ids after :after (keyset on the primary key), optionally only
-- roots created since :since.
SELECT id FROM tasks
WHERE parent_id IS NULL AND id > :after
  AND (CAST(:since AS timestamptz) IS NULL OR created_at >= CAST(:since AS timestamptz))
ORDER BY id
LIMIT :limit;

-- audit_tasks_page --
-- The tasks of the given trees after :after (keyset on id; idx_tasks_root finds them).
SELECT id, parent_id, root_id, status, to_agent, budget_tokens, budget_usd,
       idempotency_key, extract(epoch FROM created_at)::float8 AS created_at, own_tokens,
       own_usd, spent_tokens, spent_usd
FROM tasks
WHERE root_id = ANY(CAST(:roots AS uuid[])) AND id > :after
ORDER BY id
LIMIT :limit;

-- audit_events_page --
-- The events of the given tasks after (:after_task, :after_id), in each task's order
-- (keyset on ix_task_events_task_id_id), with the lease token each was written under.
-- Times as epoch seconds (a float is cheaper to decode than a timestamp, and it is what
-- a history's clock reads).
SELECT id, task_id, from_status, to_status, extract(epoch FROM at)::float8 AS at, worker,
       detail, lease_token
FROM task_events
WHERE task_id = ANY(CAST(:ids AS uuid[])) AND (task_id, id) > (:after_task, :after_id)
ORDER BY task_id, id
LIMIT :limit;

-- audit_calls_page --
-- The model calls of the given trees after :after (keyset on id; ix_model_calls_root_id).
-- ``answered``: a reply that was recorded and paid (not a failed try, not a replay's row).
SELECT id, task_id, root_id, attempt, call_index, phase, position, request_hash,
       attempt_kind, call_try, replayed,
       (error IS NULL AND response IS NOT NULL) AS answered,
       prompt_tokens + completion_tokens AS tokens, cost_usd, duration_seconds,
       extract(epoch FROM created_at)::float8 AS created_at
FROM model_calls
WHERE root_id = ANY(CAST(:roots AS uuid[])) AND id > :after
ORDER BY id
LIMIT :limit;

-- audit_steps_page --
-- The durable steps of the given trees after :after (keyset on id; task_steps' root_id).
SELECT id, task_id, root_id, phase, position, name, kind, status, idempotency_key,
       starts, cost_usd, extract(epoch FROM started_at)::float8 AS started_at,
       extract(epoch FROM finished_at)::float8 AS finished_at
FROM task_steps
WHERE root_id = ANY(CAST(:roots AS uuid[])) AND id > :after
ORDER BY id
LIMIT :limit;

-- audit_pauses_of_roots --
-- The trees among :roots paused right now, and since when.
SELECT root_id, extract(epoch FROM paused_at)::float8 AS paused_at FROM tree_pauses WHERE root_id = ANY(CAST(:roots AS uuid[]));

-- audit_roots_by_keys --
-- The roots holding any of the idempotency keys a client's history submitted with.
SELECT id, idempotency_key FROM tasks
WHERE parent_id IS NULL AND idempotency_key = ANY(CAST(:keys AS text[]));

-- audit_tasks_by_ids --
-- The tasks a client's history names (a submit's id, a cancel's or an answer's task).
SELECT id, parent_id, root_id, status FROM tasks WHERE id = ANY(CAST(:ids AS uuid[]));

-- schedule_insert --
-- Store a new schedule; a name already taken inserts nothing (the caller says so).
-- Schedules in the database (migration 0014, runtime/schedules/). Every worker, serve and
-- fire process ticks: it reads the due schedules, then handles each under its row lock
-- (schedule_lock_due, SKIP LOCKED: a schedule another process is handling is left to it).
-- A slot's schedule_runs row (unique on schedule and slot time) is inserted in the
-- transaction that inserts the root or the fires row it starts: exactly once across
-- processes and hosts, whatever the clocks say, because the row lock serialises the
-- tickers of one schedule and the unique key refuses a slot recorded before.
INSERT INTO schedules (name, cron, every_seconds, timezone, kind, task, overlap,
                       catchup_seconds, next_at, created_by)
VALUES (:name, :cron, :every_seconds, :timezone, :kind, CAST(:task AS jsonb), :overlap,
        :catchup_seconds, :next_at, :created_by)
ON CONFLICT (name) DO NOTHING
RETURNING *;

-- schedule_list_all --
-- Every schedule with its last fired slot and the number of slots recorded per state
-- (one walk of uq_schedule_runs_schedule_id_slot_at per schedule).
SELECT s.*, now() AS db_now, last.slot_at AS last_fired_at, last.root_id AS last_root_id,
       last.fire_id AS last_fire_id,
       (SELECT count(*) FROM schedule_runs r
        WHERE r.schedule_id = s.id AND r.state = 'fired') AS fired,
       (SELECT count(*) FROM schedule_runs r
        WHERE r.schedule_id = s.id AND r.state = 'skipped') AS skipped,
       (SELECT coalesce(sum(r.slots), 0) FROM schedule_runs r
        WHERE r.schedule_id = s.id AND r.state = 'missed') AS missed
FROM schedules s
LEFT JOIN LATERAL (
    SELECT r.slot_at, r.root_id, r.fire_id FROM schedule_runs r
    WHERE r.schedule_id = s.id AND r.state = 'fired'
    ORDER BY r.slot_at DESC LIMIT 1
) last ON true
ORDER BY s.name;

-- schedule_get_by_name --
-- One schedule, by name.
SELECT *, now() AS db_now FROM schedules WHERE name = :name;

-- schedule_set_paused --
-- Pause or resume a schedule. Resuming a paused one sets next_at to the first slot after
-- now (given by the caller, who reads the cadence): slots that passed while paused are
-- not caught up, since a paused schedule fires nothing. Resuming one that is not paused
-- changes nothing (its due slots are still the ticks' to fire or count as missed).
UPDATE schedules
SET paused = :paused,
    next_at = CASE WHEN paused AND NOT :paused THEN coalesce(:next_at, next_at)
                   ELSE next_at END
WHERE name = :name
RETURNING *;

-- schedule_delete_by_name --
-- Remove a schedule and its slots' rows (ON DELETE CASCADE); roots it started stay.
DELETE FROM schedules WHERE name = :name RETURNING id;

-- schedule_list_due --
-- The schedules with a slot due now, on ix_schedules_due (partial: not paused). Fire
-- schedules only for a ticker that can run a fire (:can_fire).
SELECT id FROM schedules
WHERE NOT paused AND next_at <= now() AND (kind = 'goal' OR :can_fire)
ORDER BY next_at
LIMIT :n;

-- schedule_lock_due --
-- Lock one due schedule for this tick, with the database's clock (the slots are read
-- against one clock, whichever host ticks). SKIP LOCKED: another process handling it now
-- will record its slots; waiting would only find them recorded.
SELECT *, now() AS db_now FROM schedules
WHERE id = :id AND NOT paused AND next_at <= now()
FOR UPDATE SKIP LOCKED;

-- schedule_lock_by_name --
-- Lock a schedule for run-now, waiting for a tick that holds it (it commits in
-- milliseconds), so an extra slot and a tick's slots are recorded one after the other.
SELECT *, now() AS db_now FROM schedules WHERE name = :name FOR UPDATE;

-- schedule_runs_open --
-- What the schedule started that is still open: roots not terminal, fires not finished,
-- among its last 100 fired slots (the overlap policy; older ones are long over). A fire
-- unfinished after :fire_open_seconds (longer than any fire lasts) died with its process
-- and holds up nothing.
SELECT r.slot_at, r.root_id, r.fire_id
FROM (SELECT * FROM schedule_runs
      WHERE schedule_id = :id AND state = 'fired'
      ORDER BY slot_at DESC LIMIT 100) r
LEFT JOIN tasks t ON t.id = r.root_id
LEFT JOIN fires f ON f.id = r.fire_id
WHERE (r.root_id IS NOT NULL
       AND t.status NOT IN ('done', 'failed', 'escalated', 'cancelled'))
   OR (r.fire_id IS NOT NULL AND f.id IS NOT NULL AND f.finished_at IS NULL
       AND f.started_at > now() - make_interval(secs => :fire_open_seconds))
ORDER BY r.slot_at;

-- schedule_run_insert --
-- Record one slot (or, for 'missed', :slots slots from :slot_at). The unique key on
-- (schedule_id, slot_at) refuses a slot recorded before: nothing is inserted, nothing
-- returned, and the caller starts nothing.
INSERT INTO schedule_runs (schedule_id, slot_at, state, root_id, fire_id, slots, detail,
                           worker)
VALUES (:schedule_id, :slot_at, :state, :root_id, :fire_id, :slots, :detail, :worker)
ON CONFLICT (schedule_id, slot_at) DO NOTHING
RETURNING id;

-- schedule_update_next --
-- Move a schedule's next slot on, under the row lock its tick holds.
UPDATE schedules SET next_at = :next_at WHERE id = :id;

-- schedule_runs_by_name --
-- A schedule's recorded slots, newest first, with the root's status and the time from
-- the slot to the root's insertion (the tick's latency).
SELECT r.*, t.status AS root_status, t.created_at AS root_created_at
FROM schedule_runs r
JOIN schedules s ON s.id = r.schedule_id
LEFT JOIN tasks t ON t.id = r.root_id
WHERE s.name = :name
ORDER BY r.slot_at DESC
LIMIT :n;

-- schedule_list_active --
-- The schedules not paused, with the database's clock: doctor's late-slot check.
SELECT *, now() AS db_now FROM schedules WHERE NOT paused ORDER BY next_at;

-- ======================================================================= Webhooks
-- The outbox (migration 0013): a trigger on task_events writes one row per reported
-- event per subscribed endpoint, in the transaction of the change; these statements
-- keep the endpoints and deliver the rows (runtime/webhooks/).

-- webhook_endpoint_upsert --
-- Store an endpoint, or replace the one of that name (from the configuration or `webhooks add`).
INSERT INTO webhook_endpoints (name, url, events, tenant, secret_env, source)
VALUES (:endpoint, :url, CAST(:events AS text[]), :tenant, :secret_env, :source)
ON CONFLICT (name) DO UPDATE
SET url = EXCLUDED.url, events = EXCLUDED.events, tenant = EXCLUDED.tenant,
    secret_env = EXCLUDED.secret_env, source = EXCLUDED.source
RETURNING name;

-- webhook_endpoint_delete_unconfigured --
-- Forget the endpoints that came from the configuration and are no longer in it
-- (their undelivered events go with them: ON DELETE CASCADE).
DELETE FROM webhook_endpoints
WHERE source = 'config' AND name <> ALL(CAST(:names AS text[]))
RETURNING name;

-- webhook_endpoint_list --
-- Every endpoint with its outbox counts by status (ix_webhook_outbox_pending and _dead
-- serve the two that matter; delivered rows are counted too, it is a person's listing).
SELECT w.name, w.url, w.events, w.tenant, w.secret_env, w.source, w.created_at,
       count(*) FILTER (WHERE o.status = 'pending') AS pending,
       count(*) FILTER (WHERE o.status = 'delivered') AS delivered,
       count(*) FILTER (WHERE o.status = 'dead') AS dead
FROM webhook_endpoints w
LEFT JOIN webhook_outbox o ON o.endpoint = w.name
GROUP BY w.name
ORDER BY w.name;

-- webhook_outbox_insert_test --
-- Queue a `webhook.test` event for one endpoint (`webhooks test NAME`), and wake the deliverers.
WITH ins AS (
    INSERT INTO webhook_outbox (endpoint, event, payload)
    SELECT name, 'webhook.test',
           jsonb_build_object('event', 'webhook.test', 'endpoint', name, 'at', now())
    FROM webhook_endpoints WHERE name = :endpoint
    RETURNING id, message_id, endpoint, event, status, attempts, created_at
), wake AS (
    SELECT pg_notify('{webhooks_channel}', '') FROM ins
)
SELECT ins.*, (SELECT count(*) FROM wake) AS notified FROM ins;

-- webhook_outbox_claim --
-- Lease up to :n due events, oldest first: none of an endpoint at its in-flight cap
-- (:busy), none behind an earlier pending event of the same endpoint and tree.
-- The lease (like a task's) lets another deliverer take the row back when this one dies;
-- the row keeps its message_id, so a redelivery carries the same webhook-id. A row leased
-- and not yet finished is still 'pending', so it holds back its tree's later events.
WITH picked AS (
    SELECT o.id
    FROM webhook_outbox o
    WHERE o.status = 'pending' AND o.next_attempt_at <= now()
      AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())
      AND o.endpoint <> ALL(CAST(:busy AS text[]))
      AND NOT EXISTS (
          SELECT 1 FROM webhook_outbox p
          WHERE p.status = 'pending' AND p.endpoint = o.endpoint AND p.id < o.id
            AND (p.root_id = o.root_id OR (p.root_id IS NULL AND o.root_id IS NULL)))
    ORDER BY o.id
    LIMIT :n
    -- SKIP LOCKED: two deliverers claiming at once take different rows, neither waits.
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE webhook_outbox o
    SET lease_token = :token, attempts = o.attempts + 1,
        lease_expires_at = now() + make_interval(secs => :lease_seconds)
    FROM picked p
    WHERE o.id = p.id
    RETURNING o.id, o.message_id, o.endpoint, o.event, o.root_id, o.task_id, o.payload,
              o.attempts, o.created_at
)
SELECT u.*, w.url, w.secret_env
FROM upd u JOIN webhook_endpoints w ON w.name = u.endpoint
ORDER BY u.id;

-- webhook_outbox_delivered --
-- A receiver answered 2xx: the event is delivered (fenced by the lease token: a late
-- deliverer whose lease was taken over changes nothing).
UPDATE webhook_outbox
SET status = 'delivered', delivered_at = now(), last_status = :http_status,
    last_response = :response, last_error = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE id = :id AND lease_token = :token AND status = 'pending'
RETURNING id;

-- webhook_outbox_failed --
-- An attempt failed: back off until :delay_seconds from now, or dead-letter it after
-- :max_attempts attempts (fenced by the lease token, like webhook_outbox_delivered).
UPDATE webhook_outbox
SET status = CASE WHEN attempts >= :max_attempts THEN 'dead' ELSE 'pending' END,
    next_attempt_at = now() + make_interval(secs => :delay_seconds),
    last_status = :http_status, last_error = :error, last_response = :response,
    lease_token = NULL, lease_expires_at = NULL
WHERE id = :id AND lease_token = :token AND status = 'pending'
RETURNING status;

-- webhook_outbox_list --
-- The latest deliveries, newest first; with :failed only the dead and those that failed
-- at least once and still wait.
SELECT id, message_id, endpoint, event, root_id, task_id, status, attempts, created_at,
       next_attempt_at, delivered_at, last_status, last_error, last_response
FROM webhook_outbox
WHERE (CAST(:endpoint AS text) IS NULL OR endpoint = :endpoint)
  AND (NOT :failed OR status = 'dead' OR (status = 'pending' AND last_error IS NOT NULL))
ORDER BY id DESC
LIMIT :n;

-- webhook_outbox_redeliver --
-- Send a delivered or dead event again, with the same webhook-id (receivers deduplicate),
-- and wake the deliverers. A pending one is left as it is (it goes out anyway).
WITH upd AS (
    UPDATE webhook_outbox
    SET status = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL,
        lease_token = NULL, lease_expires_at = NULL, delivered_at = NULL
    WHERE id = :id AND status IN ('delivered', 'dead')
    RETURNING id, message_id, endpoint, event, status
), wake AS (
    SELECT pg_notify('{webhooks_channel}', '') FROM upd
)
SELECT upd.*, (SELECT count(*) FROM wake) AS notified FROM upd;

-- webhook_outbox_get --
-- One outbox row by id, as webhook_outbox_list shows it.
SELECT id, message_id, endpoint, event, root_id, task_id, status, attempts, created_at,
       next_attempt_at, delivered_at, last_status, last_error, last_response
FROM webhook_outbox WHERE id = :id;

-- webhook_outbox_health --
-- For doctor: the dead letters, and the pending events older than :alert_after seconds
-- with the oldest one's age (ix_webhook_outbox_dead, ix_webhook_outbox_pending).
SELECT (SELECT count(*) FROM webhook_outbox WHERE status = 'dead') AS dead,
       count(*) AS backlog,
       extract(epoch FROM now() - min(created_at)) AS oldest_seconds
FROM webhook_outbox
WHERE status = 'pending' AND created_at < now() - make_interval(secs => :alert_after);

-- channel_listen_webhooks --
-- Subscribe to the webhook channel: the outbox trigger, a test event and a redelivery
-- notify it, so a deliverer sends within milliseconds instead of at its next poll.
LISTEN {webhooks_channel};

-- stream_horizon --
-- A tree stream's probe: the lowest transaction still open (the snapshot's xmin). Rows
-- become readable only when it passes them, so while it stands still nothing new can be
-- read and the stream's reader skips stream_read.
SELECT CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS xmin;

-- stream_root_end --
-- A tree stream's root: its status, and, when its newest transition (by id) is terminal,
-- the stream's last transaction: the newest of the root's transitions' transactions
-- (a transaction that took its id early and waited for the root's lock writes a later
-- event under an older txid), when it is readable (below the snapshot's xmin: every row
-- it or an earlier transaction wrote is readable too). No row: the tree does not exist
-- (or was pruned). Run in the same REPEATABLE READ transaction as stream_read, so both
-- see one snapshot. A transition without txid (before migration 0017) counts as txid 0.
SELECT t.status, CAST(e.txid AS text) AS end_txid
FROM tasks t
LEFT JOIN LATERAL (
    SELECT x.to_status FROM task_events x WHERE x.task_id = t.id
    ORDER BY x.id DESC LIMIT 1
) newest ON true
LEFT JOIN LATERAL (
    SELECT COALESCE(x.txid, CAST('0' AS xid8)) AS txid
    FROM task_events x WHERE x.task_id = t.id
    ORDER BY 1 DESC LIMIT 1
) e ON newest.to_status IN ('done', 'failed', 'escalated', 'cancelled')
   AND e.txid < pg_snapshot_xmin(pg_current_snapshot())
WHERE t.id = :root_id AND t.root_id = t.id;

-- stream_read --
-- The next :limit rows of a tree's stream after a cursor, gap-free: its model calls'
-- text pieces (call_text, source 0) and its tasks' transitions (task_events, source 1),
-- merged in (txid, source, id) order and read only below the snapshot's xmin, so no
-- transaction still open can later commit a row before what was read. Pieces come after
-- (:text_txid, :text_id) inclusive, transitions after (:event_txid, :event_id); the
-- caller drops what it already sent. :until_txid (or NULL): the root's terminal
-- transaction, the stream's last. :seen_txid: '0', or the xmin of the stream's last read
-- that was not a full page: every row of the tree below it has been read, so the
-- transitions are read only from it on, over every tree, on the (txid, id) index, and
-- kept when their task is the tree's (the cost is what was written since, not the tree's
-- size); with '0' (a first read, a reader back with its cursor) each of the tree's tasks'
-- transitions are read on (task_id, id).
-- A piece of an older attempt written after a newer attempt's first piece is left out
-- (a worker that lost its lease, late); the first piece of an attempt carries in
-- ``superseded`` the newest older attempt already streamed. Transitions without txid
-- (older than migration 0017) come first, by id (txid 0).
WITH horizon AS (
    SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin,
           CAST(:until_txid AS xid8) AS until_txid
), pieces AS (
    SELECT 0 AS source, c.txid, c.id, c.task_id, c.phase, c.call_index, c.attempt,
           c."offset", c.text, older.attempt AS superseded,
           CAST(NULL AS text) AS from_status, CAST(NULL AS text) AS to_status,
           CAST(NULL AS timestamptz) AS at, CAST(NULL AS text) AS agent
    FROM call_text c
    CROSS JOIN horizon h
    LEFT JOIN LATERAL (
        SELECT max(p.attempt) AS attempt FROM call_text p
        WHERE p.task_id = c.task_id AND p.phase = c.phase AND p.call_index = c.call_index
          AND p.attempt < c.attempt AND (p.txid, p.id) < (c.txid, c.id)
    ) older ON c.attempt > 1 AND NOT EXISTS (
        SELECT 1 FROM call_text f
        WHERE f.task_id = c.task_id AND f.phase = c.phase AND f.call_index = c.call_index
          AND f.attempt = c.attempt AND (f.txid, f.id) < (c.txid, c.id))
    WHERE c.root_id = :root_id
      AND (c.txid, c.id) >= (CAST(:text_txid AS xid8), CAST(:text_id AS bigint))
      AND c.txid < h.xmin
      AND (h.until_txid IS NULL OR c.txid <= h.until_txid)
      AND NOT EXISTS (
          SELECT 1 FROM call_text n
          WHERE n.task_id = c.task_id AND n.phase = c.phase
            AND n.call_index = c.call_index AND n.attempt > c.attempt
            AND (n.txid, n.id) < (c.txid, c.id))
    ORDER BY c.txid, c.id
    LIMIT :limit
), transitions AS (
    SELECT 1 AS source, e.txid, e.id, e.task_id, CAST(NULL AS text) AS phase,
           CAST(NULL AS int) AS call_index, CAST(NULL AS int) AS attempt,
           CAST(NULL AS int) AS "offset", CAST(NULL AS text) AS text,
           CAST(NULL AS int) AS superseded, e.from_status, e.to_status, e.at, e.agent
    FROM (
        SELECT x.txid, x.id, t.id AS task_id, x.from_status, x.to_status, x.at,
               t.to_agent AS agent
        FROM tasks t
        CROSS JOIN horizon h
        CROSS JOIN LATERAL (
            SELECT COALESCE(x.txid, CAST('0' AS xid8)) AS txid, x.id, x.from_status,
                   x.to_status, x.at
            FROM task_events x
            WHERE x.task_id = t.id
              AND (COALESCE(x.txid, CAST('0' AS xid8)), x.id)
                  > (CAST(:event_txid AS xid8), CAST(:event_id AS bigint))
              AND (x.txid IS NULL OR x.txid < h.xmin)
              AND (h.until_txid IS NULL
                   OR COALESCE(x.txid, CAST('0' AS xid8)) <= h.until_txid)
            OFFSET 0  -- a fence: read per task on (task_id, id), as task_tree_changes does
        ) x
        WHERE t.root_id = :root_id AND CAST(:seen_txid AS xid8) = CAST('0' AS xid8)
        UNION ALL
        SELECT x.txid, x.id, t.id, x.from_status, x.to_status, x.at, t.to_agent
        FROM task_events x
        CROSS JOIN horizon h
        JOIN tasks t ON t.id = x.task_id
        WHERE CAST(:seen_txid AS xid8) <> CAST('0' AS xid8)
          AND x.txid >= CAST(:seen_txid AS xid8)
          AND (x.txid, x.id) > (CAST(:event_txid AS xid8), CAST(:event_id AS bigint))
          AND x.txid < h.xmin
          AND (h.until_txid IS NULL OR x.txid <= h.until_txid)
          AND t.root_id = :root_id
    ) e
    ORDER BY e.txid, e.id
    LIMIT :limit
), page AS (
    SELECT CAST(txid AS text) AS txid, source, id, task_id, phase, call_index, attempt,
           "offset", text, superseded, from_status, to_status, at, agent,
           CAST(NULL AS float8) AS elapsed
    FROM (SELECT * FROM pieces UNION ALL SELECT * FROM transitions) s
    ORDER BY s.txid, s.source, s.id
    LIMIT :limit
)
SELECT * FROM page
UNION ALL
-- Last, one row (source 2) with the statement's time on the server: what the reader
-- paces itself by (a client short of CPU would see its reads as longer than they are),
-- and in txid the snapshot's xmin (the next read's :seen_txid when this page is not full).
SELECT (SELECT CAST(xmin AS text) FROM horizon), 2, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL,
       extract(epoch FROM clock_timestamp() - statement_timestamp())
FROM (SELECT count(*) FROM page) AS after_the_page;
