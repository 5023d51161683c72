"""Where the database comes from and how we reach it, one idea per module.

``ORGCHART_DATABASE_URL`` (or ``DATABASE_URL``, or ``[database] url``) names a server.
Without one, orgchart starts an embedded PostgreSQL (:mod:`.embedded`). Every orgchart
process on the machine that points at the same directory shares that one server; it
stops when the last of them exits. Migrations run on first use (:mod:`.migrations`).

- :mod:`.embedded`: the embedded server's life (start or join it, leave it; the last
  process out stops it) and ``$ORGCHART_HOME``.
- :mod:`.urls`: database URLs in libpq's and SQLAlchemy's forms (several hosts too), the
  keepalives and timeouts every connection gets (``ConnectionOptions``), passwords
  hidden for messages.
- :mod:`.failover`: which errors mean the server is gone or read-only, in-doubt
  COMMITs, the outage logged once; ``DatabaseUnavailable``.
- :mod:`.retry`: a call ridden out through a failover, with backoff, up to a deadline.
- :mod:`.engines`: the SQLAlchemy engines (a pool, or one connection at a time).
- :mod:`.migrations`: Alembic: upgrade, downgrade, the current revision, ``HEAD_REVISION``.

Nothing is re-exported here: import a name from the module that holds it.
"""
