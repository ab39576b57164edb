"""The Logit lens view's page in the app (pages/lens.py): the generic page, pages/view.py - its config's fields as
controls, its run, verdict, chart and downloads. A file named as the view's URL, because a fresh Streamlit server looks
its very first request up among the pages/ file names before app.py runs: without one, a link to /lens opened on
a fresh server answered "Page not found" (a reload worked)."""
import runpy
from pathlib import Path

from pages import ensure_navigation

ensure_navigation()  # a fresh server's first request: handed to app.py at once, before the page's imports
runpy.run_path(str(Path(__file__).with_name("view.py")))
