"""Older URL /quantized: a fresh server's first request is handed to app.py, sent on to /quant with its settings."""
from pages import ensure_navigation

ensure_navigation()
