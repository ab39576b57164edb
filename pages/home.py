import re
from pathlib import Path

import streamlit as st

from kvviz.teach.presets import all_presets, preset_state
from pages.common import PAGE_TITLES, ensure_navigation, nav_page
from pages.state import start_scenario

ensure_navigation()
if st.session_state.get("presenter"):  # Home is not drawn by pages.common.page(): the presenter stylesheet here too
    from pages.common import PRESENTER_CSS

    st.markdown(PRESENTER_CSS, unsafe_allow_html=True)
if st.session_state.get("_goto"):
    st.switch_page(nav_page(Path(st.session_state.pop("_goto")).stem))

st.title("kvviz: why does the KV cache change my numbers?")
st.markdown("""
When a model runs with a **KV cache** (`cache` — `past_key_values` before transformers 5.24), it computes the new tokens against stored keys and
values instead of recomputing the whole sequence. In exact arithmetic both ways give the same numbers. In practice
they sometimes don't, for two very different reasons:

* **precision** — 16-bit (and even 32-bit) arithmetic rounds; the cached run multiplies matrices of other shapes,
  so sums are taken in another order and round differently. Harmless in itself, but it can flip a near tie.
* **logic** — the cached run is fed the wrong thing: position ids left out with a left-padded prompt, an attention
  mask that covers only the new tokens, or a model that is not causal at all (RoBERTa).

kvviz tells them apart the way a numerical analyst would: **rerun the very same scenario in float64**. If the gap
closes, it was precision; if it stays, it is logic. **Invariant mode** (sidebar) goes one step further and proves
it: with every row computed the same way whatever the shape, a precision gap becomes exactly zero.
""")
st.subheader("Start with a scenario")
st.caption("One click sets the model, the dtype and the page's controls. Each shows its effect on any machine.")


def go(p) -> None:
    start_scenario(p, preset_state(p))
    if p.controls.get("_mx_preset"):
        st.session_state["_mx_apply_preset"] = True
    st.session_state["_goto"] = p.page


PRESETS = all_presets()
cols = st.columns(2)
for i, p in enumerate(PRESETS):
    with cols[i % 2].container(border=True):
        st.markdown(f"**{p.title}**")
        st.caption(p.what)
        title = PAGE_TITLES[Path(p.page).stem]
        st.button(f"Open in {title}", key=f"preset_{p.key}", on_click=go, args=(p,),
                  help=f"Opens the page {title} with model {p.model} in {p.dtype} and this scenario's settings")

with st.expander("Prepare the meeting: run scenarios ahead, show them at once", icon=":material/event_available:"):
    st.caption("Runs the chosen scenarios now and keeps their results, with your own runs added from any page: "
               "**Open a result** then shows each at once (no model runs during the meeting), and offers one HTML "
               "report with all of them.")
    from kvviz.teach.meeting import default_dir, prepare
    from pages.exporting import MEETING_RUNS

    picked = st.multiselect("Scenarios", [p.key for p in PRESETS], default=["tie", "padding", "proof"],
                            format_func=lambda k: next(p.title for p in PRESETS if p.key == k), key="meeting_keys")
    runs = st.session_state.get(MEETING_RUNS, [])  # this user's own runs ("Add to the meeting" beside a result)
    st.markdown(f"**Your runs** ({len(runs)})")
    if not runs:
        st.caption("None yet: press **Add to the meeting** beside a result's downloads on any page to bundle that "
                   "run (its model, prompt and settings) as it is now.")
    for r in runs:
        c1, c2 = st.columns([5, 1])
        c1.markdown("- " + re.sub(r"([\\`*_\[\]<>#|~$])", r"\\\1", r["title"]))  # a path's _ and * as typed
        c2.button("Remove", key=f"meeting_drop_{r['id']}", icon=":material/delete:",
                  on_click=lambda i=r["id"]: st.session_state.__setitem__(
                      MEETING_RUNS, [x for x in st.session_state.get(MEETING_RUNS, []) if x["id"] != i]))
    # The click is kept in state by its callback, so a rerun before this line (ensure_navigation) cannot lose it.
    st.button("Prepare", key="meeting_run", icon=":material/play_arrow:", disabled=not (picked or runs),
              on_click=st.session_state.__setitem__, args=("_meeting_asked", True))
    if st.session_state.pop("_meeting_asked", False) and (picked or runs):
        from pages.common import progress_bar, show_error

        try:
            with progress_bar("Preparing the meeting…") as report:
                done = prepare(picked, default_dir(), progress=report, runs=[r["json"] for r in runs])
        except Exception as e:  # noqa: BLE001
            show_error(e)
        else:
            st.success(f"{len(done)} result(s) ready in **Open a result** (and one report with all of them).")
            st.page_link("pages/open_result.py", label="Open a result", icon=":material/folder_open:")

st.subheader("Pages")
st.markdown("""
* **Split point** — feed a prefix, cache it, feed the rest: where (layer × token) and how much the numbers differ
  from one full forward, against the dtype's machine epsilon, with a verdict and its proof; a bisector names the
  first module that differs.
* **Greedy paths** — decode with and without cache (and with `generate()`, and the loop people write): the texts
  side by side, the step where they part, the top-2 margin there, and the verdict for that step.
* **Dtypes side by side**, **Padding and batching**, **Prompt-cache reuse**, **Loading trap** — the classic traps.
* **Backends & compile** — attention kinds × cache kinds × torch.compile × precision flags, repeated.
* **KV cache** — save a cache, load it back, continue, compare; sizes. **Is my model cache-safe?** — one card.
* **Open a result** — look at a downloaded result again, no model needed.

The **Guide** page tells where each scenario comes from and how to read the numbers; the **Glossary** explains the
terms. Pick the model, dtype, device and attention implementation in the sidebar; they apply to every page.
""")
