"""Every query of the foundation: the worker runtime's leases (table ``leases``)."""

# Take (or renew) every partition that is free, expired or already ours; the fence grows on a takeover.
ACQUIRE_LEASES = """
INSERT INTO leases AS l (kind, partition, owner, expires_at)
SELECT %(kind)s, p, %(owner)s, now() + make_interval(secs => %(ttl)s)
FROM unnest(%(partitions)s::text[]) AS p
ON CONFLICT (kind, partition) DO UPDATE
    SET owner = EXCLUDED.owner,
        expires_at = EXCLUDED.expires_at,
        fence = l.fence + (l.owner <> EXCLUDED.owner OR l.expires_at <= now())::int,
        acquired_at = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > now()
                           THEN l.acquired_at ELSE now() END
    WHERE l.owner = EXCLUDED.owner OR l.expires_at <= now()
RETURNING partition, fence
"""

# Give partitions up at once (they expire now).
RELEASE_LEASES = """
UPDATE leases SET expires_at = '-infinity'
WHERE kind = %(kind)s AND owner = %(owner)s AND partition = ANY(%(partitions)s::text[])
"""

# Is the lease still ours and unexpired? Share-locks the row until the transaction ends.
CHECK_LEASE = """
SELECT 1 FROM leases
WHERE kind = %(kind)s AND partition = %(partition)s AND owner = %(owner)s AND fence = %(fence)s
  AND expires_at > now()
FOR SHARE
"""

# CHECK_LEASE for several partitions of one kind and owner at once: the partitions still held.
CHECK_LEASES = """
SELECT l.partition FROM leases l
JOIN unnest(%(partitions)s::text[], %(fences)s::bigint[]) AS u(partition, fence)
  ON l.kind = %(kind)s AND l.partition = u.partition AND l.fence = u.fence
WHERE l.owner = %(owner)s AND l.expires_at > now()
ORDER BY l.partition
FOR SHARE OF l
"""
