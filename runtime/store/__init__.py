"""The store: the one door to PostgreSQL (named SQL, the Store, rows, models, the server)."""
