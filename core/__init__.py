"""Control-plane foundations: settings, database, tables, domain errors, ids, clock, storage.

`core` knows nothing of HTTP, Celery or torch; it may import only the `treadle` wire types.
"""
