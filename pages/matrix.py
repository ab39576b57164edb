"""Page: attention × cache kind × compile × precision flags, repeated."""
import collections

import streamlit as st

from pages.defaults import DEFAULTS
from kvviz.views.matrix import figures as matrix_figures
from kvviz.core.backends import CACHE_KINDS, COMPILE_MODES
from kvviz.views.matrix.run import MatrixConfig, sliding_window_config
from kvviz.teach.firstscreen import matrix_why
from kvviz.core.verdict import worst as worst_of
from pages.common import controls, page, show_verdict, side_by_side
from pages.runner import page_message, run_button, run_or_stop
from pages.exporting import exports

FLAG_SETS = {"none": (), "tf32": ("tf32",), "deterministic": ("deterministic",),
             "no reduced-precision reductions": ("no-bf16-reduced-reduction", "no-fp16-reduced-reduction"),
             "sdpa=math": ("sdpa=math",)}

choice, lm = page("Backends & compile",
                  "Greedy decoding under each attention implementation × cache kind × torch.compile × precision "
                  "flags, repeated, against the eager no-cache loop: which settings change the text, by how much, "
                  "and whether repeats even agree. Settings that cannot run here are grey cells with their reason.")

def use_sliding_window_preset() -> None:
    """Fill the controls with the sliding-window scenario (a callback: it runs before the widgets are drawn)."""
    try:
        p = sliding_window_config(lm)
    except Exception as e:  # noqa: BLE001
        st.session_state["matrix_preset_error"] = str(e)
        return
    st.session_state.update(matrix_prompt=p.prompt, matrix_batch="\n".join(p.batch_with), matrix_n=p.max_new_tokens,
                            matrix_attn=list(p.attentions), matrix_cache=list(p.caches), matrix_preset_error=None,
                            _mx_autorun=True)  # a scenario picks its axes and runs them: no Run click


with controls():
    if st.session_state.pop("_mx_apply_preset", False):  # opened from a Home preset
        use_sliding_window_preset()
    st.button("Sliding-window preset (the torch.compile report): a short left-padded prompt batched with one longer than the window",
              key="matrix_preset", on_click=use_sliding_window_preset)
    if st.session_state.get("matrix_preset_error"):
        with page_message():
            st.error(st.session_state["matrix_preset_error"], icon="⚠️")
    prompt = st.text_area("Prompt (row 0)", DEFAULTS["matrix"]["prompt"], key="matrix_prompt", height=70)
    batch = st.text_area("Batch it with (one prompt a line; empty: alone)", "", key="matrix_batch", height=60)
    c1, c2, c3, c4 = st.columns(4)
    n = c1.number_input("New tokens", 1, 256, DEFAULTS["matrix"]["n"], key="matrix_n")
    repeats = c2.number_input("Repeats", 1, 20, DEFAULTS["matrix"]["repeats"], key="matrix_rep")
    left_pad = c3.number_input("Left padding", 0, 64, 0, key="matrix_pad")
    pos = c4.radio("Position ids", ["auto", "omit"], horizontal=True, key="matrix_pos")
    a1, a2, a3, a4 = st.columns(4)
    attns = a1.multiselect("Attention", ["eager", "sdpa", "flex_attention", "flash_attention_2"], list(DEFAULTS["matrix"]["attn"]),
                           key="matrix_attn")
    caches = a2.multiselect("Cache kind", [k.value for k in CACHE_KINDS], list(DEFAULTS["matrix"]["cache"]), key="matrix_cache")
    compiles = a3.multiselect("torch.compile", list(COMPILE_MODES), ["off"], key="matrix_compile",
                              help="Compiling takes a while the first time (about a minute on a CPU).")
    flags = a4.multiselect("Precision flags", list(FLAG_SETS), ["none"], key="matrix_flags")
    cfg = MatrixConfig(prompt=prompt, max_new_tokens=int(n), attentions=tuple(attns), caches=tuple(caches),
                       compiles=tuple(compiles), flag_sets=tuple(FLAG_SETS[f] for f in flags), repeats=int(repeats),
                       left_pad=int(left_pad), position_ids=pos,
                       batch_with=tuple(t for t in batch.splitlines() if t.strip()), invariant=choice.invariant)
st.caption(f"{len(cfg.cells())} cells × {int(repeats)} repeats, each {int(n)} tokens.")
D = DEFAULTS["matrix"]
default_cfg = MatrixConfig(prompt=D["prompt"], max_new_tokens=D["n"], attentions=tuple(D["attn"]),
                           caches=tuple(D["cache"]), compiles=("off",), flag_sets=((),), repeats=D["repeats"],
                           invariant=choice.invariant)
# a scenario's axes and the page's default axes (seconds) run at once; other axes wait for the click (can be long)
run_button("matrix", cfg, "Run the matrix", "Pick the axes and press **Run the matrix**.", ignores=("attn",),
           auto=st.session_state.pop("_mx_autorun", False) or cfg == default_cfg, type="primary", key="matrix_run")

# its attentions are its own axis: the sidebar's is not one of its inputs
res = run_or_stop("matrix", lm, cfg, ignores=("attn",), label="Running the cells…")

counts = collections.Counter(c.verdict or "could not run" for c in res.cells)
worst = worst_of(counts) or "could not run"
why, fix = matrix_why(res, choice.invariant)  # an identical first screen says why, with one click
show_verdict(worst, f"The worst of {len(res.cells)} cells against the no-cache eager reference — "
             + ", ".join(f"{v}: {n}" for v, n in counts.items()) + ". Pick a cell below the grid for its steps."
             + (f" {why}" if why else ""))
if fix:
    st.button("Switch to bfloat16 (shows the reordering)", key="matrix_show_gap", type="primary",
              icon=":material/visibility:", on_click=st.session_state.update, kwargs={"dtype": "bfloat16"})
st.plotly_chart(matrix_figures.matrix_grid(res), width="stretch", key="matrix_grid")
st.caption(f"Reference (eager, no cache, {res.settings['dtype']}): “{res.reference['text']}”. float64 reference: "
           f"“{res.reference['float64_text']}”.")
labels = [c.label for c in res.cells]
pick = st.selectbox("Cell details", labels, key="matrix_cell")
cell = res.cells[labels.index(pick)]
if cell.error:
    st.warning(f"This combination cannot run here: {cell.error}")
else:
    st.plotly_chart(matrix_figures.matrix_cell_steps(cell), width="stretch", key="matrix_steps")
    side_by_side(("**This cell**", cell.text), ("**Reference**", res.reference["text"]))
env = res.environment
st.caption(f"torch {env['torch']}, transformers {env['transformers']}, {env['device_name']}; computed in "
           f"{res.elapsed_s:.1f} s.")
exports(res, "matrix", lm)
