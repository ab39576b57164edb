"""Older URL /split_point: a fresh server's first request is handed to app.py, sent on to /split with its settings."""
from pages import ensure_navigation

ensure_navigation()
