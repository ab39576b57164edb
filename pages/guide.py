"""Page: docs/guide.md inside the app - where each scenario comes from, how to read the numbers."""
from pathlib import Path

import streamlit as st

from pages.common import ensure_navigation

ensure_navigation()
st.markdown((Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text(encoding="utf-8"))
