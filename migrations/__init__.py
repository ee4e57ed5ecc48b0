"""Alembic environment and revisions for Treadle's schema (core and billing tables)."""
