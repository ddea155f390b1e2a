"""Tuning: the on-disk tuning database (db.py) and the `moegen cache` commands (cache_cli.py)."""
