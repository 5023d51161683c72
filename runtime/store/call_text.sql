-- The statements of streamed model-call text (table call_text, migration 0017), in the
-- layout of queries.sql: "-- name --", a one-line description, then the SQL.

-- call_text_write_many --
-- Write a batch of streamed pieces (one JSON array), each fenced by its task's lease token.
-- A piece of a stream whose attempt is not known yet (its first write) gets one here: the
-- stream's own row above what its delivery knew (the COMMIT of an earlier try of this
-- very statement landed: same attempt, nothing written twice), else the call's next
-- attempt (max + 1). A piece whose key (task, phase, call, attempt, offset) is stored
-- already is not stored again. Returns, for every fenced piece, its attempt and whether the row at its
-- key is its delivery's (false: another delivery took that attempt first; none returned:
-- the lease is gone). The task rows are read FOR KEY SHARE: a reclaim that committed
-- first is seen (the write is refused), and the charges' updates of the same rows never
-- wait for it. Commits without waiting for the disk (this transaction only): a piece is
-- shown as it streams, and the reply itself is the model_calls row; WAL is flushed in
-- order, so the task's next synchronous commit makes its earlier pieces durable too.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb))
        AS i(n int, task_id uuid, token uuid, phase text, call_index int, attempt int,
             known int, "offset" int, text text)
), me AS (
    SELECT t.id, t.root_id, t.lease_token FROM tasks t
    WHERE t.id IN (SELECT task_id FROM input)
      AND set_config('synchronous_commit', 'off', true) IS NOT NULL
    ORDER BY t.id
    FOR KEY SHARE
), numbered AS (
    SELECT i.n, me.root_id, i.task_id, i.token, i.phase, i.call_index, i."offset", i.text,
           COALESCE(
               i.attempt,
               (SELECT min(c.attempt) FROM call_text c
                WHERE c.task_id = i.task_id AND c.phase = i.phase
                  AND c.call_index = i.call_index AND c.lease_token = i.token
                  AND c.attempt > i.known),
               (SELECT COALESCE(max(c.attempt), 0) + 1 FROM call_text c
                WHERE c.task_id = i.task_id AND c.phase = i.phase
                  AND c.call_index = i.call_index)) AS attempt
    FROM input i JOIN me ON me.id = i.task_id AND me.lease_token = i.token
), ins AS (
    -- NOT EXISTS rather than ON CONFLICT: a speculative insertion writes one more WAL
    -- record per row (about 8% of a piece's WAL). The one race it leaves (another
    -- delivery's first write at the same key, committed meanwhile) is a unique violation,
    -- and the writer writes the batch again (then this sees that row).
    INSERT INTO call_text (root_id, task_id, phase, call_index, attempt, "offset", text,
                           lease_token)
    SELECT nb.root_id, nb.task_id, nb.phase, nb.call_index, nb.attempt, nb."offset",
           nb.text, nb.token
    FROM numbered nb
    WHERE NOT EXISTS (SELECT 1 FROM call_text c
                      WHERE c.task_id = nb.task_id AND c.phase = nb.phase
                        AND c.call_index = nb.call_index AND c.attempt = nb.attempt
                        AND c."offset" = nb."offset")
    ORDER BY nb.n
    RETURNING task_id, phase, call_index, attempt, "offset"
)
SELECT nb.n, nb.attempt,
       (EXISTS (SELECT 1 FROM ins
                WHERE ins.task_id = nb.task_id AND ins.phase = nb.phase
                  AND ins.call_index = nb.call_index AND ins.attempt = nb.attempt
                  AND ins."offset" = nb."offset")
        OR EXISTS (SELECT 1 FROM call_text c
                   WHERE c.task_id = nb.task_id AND c.phase = nb.phase
                     AND c.call_index = nb.call_index AND c.attempt = nb.attempt
                     AND c."offset" = nb."offset" AND c.lease_token = nb.token)) AS ours
FROM numbered nb;

-- call_text_cut_off --
-- The recorded text of a call cut off mid-generation, to continue from: the text of the
-- call's last attempt (its pieces contiguous from offset 0) when the call has no
-- model_calls row at all (no reply of it ever arrived: its worker died while the model
-- generated). No row otherwise: the call is made again whole.
WITH last AS (
    SELECT max(attempt) AS attempt FROM call_text
    WHERE task_id = :task_id AND phase = :phase AND call_index = :call_index
)
SELECT last.attempt, string_agg(c.text, '' ORDER BY c."offset") AS text
FROM last JOIN call_text c
  ON c.task_id = :task_id AND c.phase = :phase AND c.call_index = :call_index
 AND c.attempt = last.attempt
WHERE NOT EXISTS (SELECT 1 FROM model_calls m
                  WHERE m.task_id = :task_id AND m.phase = :phase
                    AND m.call_index = :call_index)
GROUP BY last.attempt
HAVING min(c."offset") = 0
   AND sum(char_length(c.text)) = max(c."offset" + char_length(c.text));

-- call_text_newest --
-- The newest piece of a tree's streamed text, by (txid, id): the (root_id, txid, id)
-- index read backwards, one row. What a subscribed MCP tree resource compares to hear
-- text arrive (no row: the tree has no text yet).
SELECT CAST(txid AS text) AS txid, id FROM call_text
WHERE root_id = :root_id
ORDER BY txid DESC, id DESC
LIMIT 1;

-- call_text_running --
-- The text so far of each running task's newest call in a tree (running or judging):
-- the attempt of the task's newest piece, its pieces put together by offset. What the
-- MCP tree resource shows as "streaming"; a task between calls shows its last one.
SELECT t.id AS task_id, n.phase, n.call_index, n.attempt,
       (SELECT string_agg(c.text, '' ORDER BY c."offset") FROM call_text c
        WHERE c.task_id = t.id AND c.phase = n.phase AND c.call_index = n.call_index
          AND c.attempt = n.attempt) AS text
FROM tasks t
CROSS JOIN LATERAL (
    SELECT p.phase, p.call_index, p.attempt FROM call_text p
    WHERE p.task_id = t.id
    ORDER BY p.txid DESC, p.id DESC
    LIMIT 1
) n
WHERE t.root_id = :root_id AND t.status IN ('running', 'judging')
ORDER BY t.id;
