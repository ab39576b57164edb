"""Older URL /kv_cache: a fresh server's first request is handed to app.py, sent on to /cache with its settings."""
from pages import ensure_navigation

ensure_navigation()
