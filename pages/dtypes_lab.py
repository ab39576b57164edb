"""Older URL /dtypes_lab: a fresh server's first request is handed to app.py, sent on to /dtypes with its settings."""
from pages import ensure_navigation

ensure_navigation()
