"""Treadle client: wire types and (soon) the customer-facing clients.

This package knows nothing of the server's internals; the server imports its wire types so the
two cannot drift.
"""

__version__ = "0.1.0"
