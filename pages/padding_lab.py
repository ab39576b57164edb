"""Older URL /padding_lab: a fresh server's first request is handed to app.py, sent on to /padding with its settings."""
from pages import ensure_navigation

ensure_navigation()
