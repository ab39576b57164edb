"""Older URL /greedy_paths: a fresh server's first request is handed to app.py, sent on to /greedy with its settings."""
from pages import ensure_navigation

ensure_navigation()
