"""Older URL /cache_safety: a fresh server's first request is handed to app.py, sent on to /check with its settings."""
from pages import ensure_navigation

ensure_navigation()
