"""Page: greedy decoding with and without cache, where the paths part and why."""
import streamlit as st

from kvviz import views
from pages.defaults import DEFAULTS
from kvviz.views.greedy import figures as greedy_figures
from kvviz.views.greedy.run import DEFAULT_PATHS, MAX_NEW_TOKENS, PATH_LABELS, PATHS, GreedyConfig, GreedyPath
from kvviz.core.inputs import POSITION_MODES
from kvviz.teach.firstscreen import greedy_closest_call
from pages.common import controls, page, show_verdict, verdict_and_chart
from pages.runner import run_or_stop
from pages.ab import ab_run, show_ab
from pages.exporting import exports

choice, lm = page("Greedy paths",
                  "Decode greedily without cache, with cache, with generate() (and the loop people write): the texts side "
                  "by side, the step where they part, how close that decision was, and whether it is rounding or logic.")

with controls():
    # defaults through session state only (a scenario sets these keys: a widget default as well would warn)
    for k, v in (("greedy_prompt", DEFAULTS["greedy"]["prompt"]), ("greedy_n", DEFAULTS["greedy"]["n"]),
                 ("greedy_paths", list(DEFAULT_PATHS))):
        st.session_state.setdefault(k, v)
    prompt = st.text_area("Prompt", key="greedy_prompt", height=80)
    c1, c2, c3 = st.columns(3)
    n_new = c1.number_input("New tokens", 1, MAX_NEW_TOKENS, key="greedy_n")
    left_pad = c2.number_input("Left padding", 0, 64, 0, key="greedy_pad")
    pos_mode = c3.radio("Position ids (cache path)", POSITION_MODES, horizontal=True, key="greedy_pos")
    paths = st.multiselect("Paths", PATHS, key="greedy_paths", format_func=PATH_LABELS.get)
    o1, o2 = st.columns(2)
    fast = o1.toggle("Fast preview (teacher-forced no-cache path)", False, key="greedy_fast",
                     help="One full forward over the cache path's tokens gives every step's no-cache logits; own "
                          "forwards only after the paths part. Steps whose margin is within the gap are not settled.")
    stop = o2.toggle("Stop at the first divergence", False, key="greedy_stop")

cfg = GreedyConfig(prompt=prompt, max_new_tokens=int(n_new), left_pad=int(left_pad), position_ids=pos_mode,
                   paths=tuple(paths), fast=fast, stop_at_divergence=stop)
VIEW = views.get("greedy")
res = run_or_stop(VIEW, lm, cfg, label="Decoding…")

parting = [p for p in res.pairs if p.first_divergence is not None]
left, right = verdict_and_chart((1, 1))
with left:
    if not parting:
        show_verdict("identical", f"All {len(res.paths)} paths chose the same {res.steps} tokens."
                     + (" Invariant mode is on: the paths' logits agree bit for bit wherever their logic is the same."
                        if choice.invariant else " " + greedy_closest_call(res)))
        if not choice.invariant:
            # Where a real model meets a near tie depends on the machine's kernels: the one click opens the
            # constructed scenario whose paths part on every machine (tiny:flip in bfloat16), for this page only
            from kvviz.teach.presets import PRESETS, preset_state
            from pages.state import start_scenario

            tie = next(p for p in PRESETS if p.key == "flip")
            st.button("Show a near tie (flips on any machine)", key="greedy_show_tie", icon=":material/visibility:",
                      type="primary", on_click=start_scenario, args=(tie, preset_state(tie)),
                      help=f"A scenario: {tie.model} in {tie.dtype}. {tie.what} Used on this page only: another "
                           "page, another model or Reset to defaults brings back the defaults.")
    else:
        first = min(parting, key=lambda p: p.first_divergence)
        show_verdict(first.verdict, first.explanation, first.proof, proof_in_explanation=first.proof_in_explanation,
                     proved=first.proved)
    if choice.spec == "tiny:flip":  # the constructed cache flip: how it was built, in one sentence
        from kvviz.models.tiny import FLIP_BUILT

        st.caption(FLIP_BUILT)
    st.markdown(greedy_figures.texts_html(res), unsafe_allow_html=True)
    if res.settings.fast:
        st.caption("⚡ Fast preview: hollow markers are steps not settled (margin within the measured gap).")
with right:
    st.plotly_chart(greedy_figures.greedy_margins(res), width="stretch", key="greedy_margin_chart")
pair_names = [f"{p.a} vs {p.b}" for p in res.pairs]
primary = greedy_figures.primary_pair(res)
sel = st.selectbox("Hidden-state heatmap for", pair_names, index=res.pairs.index(primary), key="greedy_pair")
log = st.toggle("Log colours", True, key="greedy_log", help="Colour the gaps on a log scale")
st.plotly_chart(greedy_figures.greedy_heatmap(res, res.pairs[pair_names.index(sel)], log), width="stretch",
                key="greedy_heatmap")
with st.expander("A/B: this decoding against one other setting, on one colour scale"):
    b = None
    if not {GreedyPath.NO_CACHE, GreedyPath.CACHE} <= set(res.paths):
        st.info("A/B compares the no-cache and cache paths under two settings: choose both paths above to use it.")
    else:
        b = ab_run(VIEW, choice, lm, cfg, {"position ids (cache path)": (
            "position_ids", [m for m in POSITION_MODES if m != pos_mode])}, "Decodes once more with B's setting")
    if b is not None:
        def parting_of(r):
            p = r.pair(GreedyPath.NO_CACHE, GreedyPath.CACHE)
            return "same tokens" if p.first_divergence is None else f"part at step {p.first_divergence}"

        show_ab(greedy_figures.ab_greedy_heatmaps(res, b.result, f"{b.label_a}: {parting_of(res)}",
                                           f"{b.label_b}: {parting_of(b.result)}", log), "greedy",
                "No cache vs cache in both; same colour scale on both maps, the third is their difference; the red "
                "line marks where each pair's texts part. Under each map: the cached path's text.",
                (res.paths[GreedyPath.CACHE].text, b.result.paths[GreedyPath.CACHE].text), side_by_side=False)
ref = greedy_figures.greedy_reference_gap(res)
if ref is not None:
    st.plotly_chart(ref, width="stretch", key="greedy_ref_chart")
t1, t2, t3 = st.tabs(["Per step", "Pairs", "Forwards and time"])
with t1:
    st.dataframe(greedy_figures.greedy_step_frame(res), hide_index=True, width="stretch")
with t2:
    st.dataframe(greedy_figures.greedy_pairs_frame(res), hide_index=True, width="stretch")
    for p in parting:
        st.caption(f"**{p.a} vs {p.b}** — {p.explanation}" + (f" :material/lock: {p.proof}" if p.proof else ""))
with t3:
    st.dataframe([{"path": p.label, "forwards": p.forwards, "seconds": round(p.seconds, 3)}
                  for p in res.paths.values()], hide_index=True, width="stretch")
for note in res.notes:
    st.caption(f"ℹ️ {note}")
exports(res, "greedy", lm)
