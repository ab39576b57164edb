"""The Logit lens view's page: the generic page, pages/view.py. A file named as the view's URL, because a fresh
server looks its very first request up among the pages/ file names before app.py runs ("Page not found" without)."""
import runpy
from pathlib import Path

from pages import ensure_navigation

ensure_navigation()  # a fresh server's first request: handed to app.py at once, before the page's imports
runpy.run_path(str(Path(__file__).with_name("view.py")))
