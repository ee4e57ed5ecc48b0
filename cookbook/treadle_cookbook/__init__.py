"""Recipes built on the treadle client. Imports `treadle` only."""
