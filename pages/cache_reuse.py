"""Older URL /cache_reuse: a fresh server's first request is handed to app.py, sent on to /reuse with its settings."""
from pages import ensure_navigation

ensure_navigation()
