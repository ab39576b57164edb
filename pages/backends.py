"""Older URL /backends: a fresh server's first request is handed to app.py, sent on to /matrix with its settings."""
from pages import ensure_navigation

ensure_navigation()
