-- The statements of the journal of model replies (table call_replies, migration 0019), in
-- the layout of queries.sql: "-- name --", a one-line description, then the SQL.

-- call_replies_journal --
-- Journal a batch of replies (one JSON array of model_calls rows as the charge writes
-- them: task_charge_running_many's input) the moment they arrive: one row each, nothing
-- else read or locked but the foreign key's check of each task row (FOR KEY SHARE: no
-- worker's update of a task waits for it). Not fenced: whether a reply counts is decided
-- when it is adopted (call_replies_adopt), under the lease of the delivery that adopts it.
-- Commits synchronously: this is the reply's durable record until its charge commits.
INSERT INTO call_replies (task_id, lease_token, reply)
SELECT CAST(r->>'id' AS uuid), CAST(r->>'token' AS uuid), r
FROM jsonb_array_elements(CAST(:batch AS jsonb)) AS r;

-- call_replies_fence --
-- The tasks of a batch (:batch, [{"id", "token"}]) still held under the given lease
-- tokens, their rows locked (FOR NO KEY UPDATE, in id order: as a charge locks them) until
-- the adoption's transaction ends: a charge of these tasks waits for it, and the adoption
-- (the next statement, a fresh snapshot) sees every charge that committed before.
SELECT t.id FROM tasks t
JOIN jsonb_to_recordset(CAST(:batch AS jsonb)) AS i(id uuid, token uuid)
  ON t.id = i.id AND t.lease_token = i.token
ORDER BY t.id
FOR NO KEY UPDATE OF t;

-- call_replies_adopt --
-- Adopt, for each task of :batch held under its given lease token (call_replies_fence
-- locked them), the replies journaled by its earlier deliveries (another lease token)
-- whose charge never committed: each becomes its model_calls row (as the charge would
-- have written it; created_at: when it arrived) and is charged to the task's spend, under
-- the adopting lease. Exactly once: the journal rows are deleted as they are adopted (a
-- second adopter waits on the task rows, then finds none); a reply is not adopted when
-- its own row is on record (its charge committed: the same attempt, call, try, kind,
-- phase, position and request), nor when a successful reply to the same request is (a
-- later delivery made the call again: a late worker's journal entry charges nothing).
-- The tree's fair-time clock is not advanced by adopted replies (a scheduling weight,
-- not money). The deleted rows of other lease tokens are the task's whole earlier
-- journal. Returns the replies adopted and the journal rows taken.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb)) AS i(id uuid, token uuid)
), live AS (
    SELECT t.id, t.root_id, i.token FROM tasks t
    JOIN input i ON t.id = i.id AND t.lease_token = i.token
), taken AS (
    DELETE FROM call_replies r USING live
    WHERE r.task_id = live.id AND r.lease_token <> live.token
    RETURNING r.id AS journal_id, r.task_id, live.root_id, r.reply, r.arrived_at
), parsed AS (
    SELECT k.journal_id, k.task_id, k.root_id, k.arrived_at, c.*
    FROM taken k,
         jsonb_to_record(k.reply) AS c(attempt int, call_index int, backend text,
                                       route text, model text, prompt text, response text,
                                       prompt_tokens int, completion_tokens int,
                                       duration_seconds double precision, usd numeric,
                                       error text, phase text, position text,
                                       request_hash text, attempt_kind text, call_try int,
                                       thinking text, tool_calls jsonb)
), fresh AS (
    SELECT DISTINCT ON (p.task_id, p.phase, p.position, p.request_hash) p.*
    FROM parsed p
    WHERE p.error IS NULL
      AND NOT EXISTS (
          SELECT 1 FROM model_calls m
          WHERE m.task_id = p.task_id AND m.attempt = p.attempt
            AND m.call_index = p.call_index AND m.call_try = p.call_try
            AND m.attempt_kind = p.attempt_kind AND m.phase = p.phase
            AND m.position IS NOT DISTINCT FROM p.position
            AND m.request_hash IS NOT DISTINCT FROM p.request_hash AND NOT m.replayed)
      AND NOT EXISTS (
          SELECT 1 FROM model_calls m
          WHERE m.task_id = p.task_id AND m.phase = p.phase
            AND m.position IS NOT DISTINCT FROM p.position
            AND m.request_hash IS NOT DISTINCT FROM p.request_hash
            AND m.error IS NULL AND m.response IS NOT NULL AND NOT m.replayed)
    ORDER BY p.task_id, p.phase, p.position, p.request_hash, p.journal_id
), calls AS (
    INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                             prompt, response, prompt_tokens, completion_tokens,
                             duration_seconds, cost_usd, error, phase, position,
                             request_hash, attempt_kind, call_try, replayed, thinking,
                             tool_calls, created_at)
    SELECT f.task_id, f.root_id, f.attempt, f.call_index, f.backend, f.route, f.model,
           f.prompt, f.response, f.prompt_tokens, f.completion_tokens, f.duration_seconds,
           f.usd, NULL, f.phase, f.position, f.request_hash, f.attempt_kind, f.call_try,
           false, f.thinking, f.tool_calls, f.arrived_at
    FROM fresh f
    ORDER BY f.journal_id
    RETURNING task_id, prompt_tokens + completion_tokens AS tokens, cost_usd
), spent AS (
    UPDATE tasks t
    SET own_tokens = t.own_tokens + s.tokens,
        own_usd = t.own_usd + s.usd,
        spent_tokens = t.spent_tokens + s.tokens,
        spent_usd = t.spent_usd + s.usd,
        updated_at = now()
    FROM (SELECT task_id, sum(tokens) AS tokens, sum(cost_usd) AS usd
          FROM calls GROUP BY task_id) s
    WHERE t.id = s.task_id
    RETURNING t.id
)
SELECT (SELECT count(*) FROM calls) AS adopted, (SELECT count(*) FROM taken) AS taken,
       (SELECT count(*) FROM spent) AS tasks;
