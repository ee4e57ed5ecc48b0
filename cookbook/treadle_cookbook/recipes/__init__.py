"""Runnable recipes: `python -m treadle_cookbook.recipes.<name> --help` lists each one's settings."""
