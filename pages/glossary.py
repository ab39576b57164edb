"""Page: the terms the other pages use - docs/glossary.md inside the app."""
from pathlib import Path

import streamlit as st

from pages.common import ensure_navigation

ensure_navigation()
st.title("Glossary")
text = (Path(__file__).resolve().parents[1] / "docs" / "glossary.md").read_text(encoding="utf-8")
st.markdown(text.split("\n", 3)[3])  # below the file's own title and line: the page has its title
