"""Page: prefix → cache → rest, compared with one full forward."""
import streamlit as st

import kvviz
from kvviz import views
from kvviz.core import plotting
from kvviz.views.split import figures as split_figures
from kvviz.core.inputs import MASK_MODES, POSITION_MODES, encode
from kvviz.core.metrics import HIDDEN_METRICS
from kvviz.teach.firstscreen import rounding_away_note, split_identical_why
from pages.common import controls, page, show_verdict, verdict_and_chart
from pages.defaults import DEFAULTS
from pages.state import linked_slider_box
from pages.runner import page_message, run_or_stop, run_view, show_error
from pages.ab import ab_run, show_ab
from pages.exporting import exports

# Presenter mode's heatmap at most this tall: at 1280×720 it starts ~250 px down (tests/test_theme_browser.py measures
# that its last layer and its token axis are in the first screen)
PRESENTER_HEATMAP_PX = 450

choice, lm = page("Split point",
                  "Feed tokens [0, k) and cache them, then feed the rest through the cache (`cache` — "
                  "`past_key_values` before transformers 5.24); compare every hidden state, the logits and the "
                  "keys/values with one full forward without cache.")

with controls():
    prompt = st.text_area("Prompt", DEFAULTS["split"]["prompt"], key="split_prompt", height=90)
    try:
        ids = encode(lm, prompt)
    except kvviz.KvvizError as e:
        with page_message():
            show_error(e)
        st.stop()
    tokens = [lm.tokenizer.decode([i]) for i in ids]
    if (n := len(tokens)) < 2:
        with page_message():
            st.warning("The prompt is a single token; a split needs at least 2 tokens.")
        st.stop()

    c1, c2 = st.columns([3, 2])
    with c1:
        if n - 1 > 1:
            split = linked_slider_box("split_k", "Split point k: tokens before k go to the cache", 1, n - 1,
                                      min(max(1, n // 2), n - 1), "k", help="Type k exactly (long prompts)")
        else:
            split = 1
            st.caption("Split point k = 1 (the only one for a 2-token prompt)")
        st.markdown(split_figures.token_strip(tokens, split), unsafe_allow_html=True)
        st.caption(f"{n} tokens: {split} cached (blue), {n - split} fed after the cache and compared.")
    with c2:
        mode = st.radio("Feed the rest", ["chunk", "step"], horizontal=True, key="split_mode",
                        format_func={"chunk": "in one chunk", "step": "token by token"}.get)
        st.session_state.setdefault("split_pad", 0)  # a scenario sets it: no widget default as well
        left_pad = st.number_input("Left padding (pad tokens before the prompt)", 0, 64, key="split_pad")
        pos_mode = st.radio("Position ids for the rest", POSITION_MODES, horizontal=True, key="split_pos",
                            help="auto: derived from the attention mask, as generate() does. omit: let the model "
                                 "count from the cache length (wrong when the prompt is left-padded: the pads get "
                                 "counted; see docs/guide.md).")
        mask_mode = st.radio("Attention mask for the rest", MASK_MODES, horizontal=True, key="split_mask",
                             help="full: past + new tokens (correct). new-only: only the new tokens, a common mistake "
                                  "that transformers accepts silently.")

cfg = kvviz.SplitConfig(prompt=prompt, split=int(split), mode=mode, left_pad=int(left_pad), position_ids=pos_mode,
                        attention_mask=mask_mode)
VIEW = views.get("split")
res = run_or_stop(VIEW, lm, cfg, label="Comparing…")

left, right = verdict_and_chart()
with left:
    why, fix = split_identical_why(res, choice.invariant)  # an identical first screen says why, with one click
    show_verdict(res.verdict, res.explanation + (f" {why}" if why else ""), res.proof,
                 proof_in_explanation=res.proof_in_explanation, proved=res.proved)
    if fix:
        st.button({"step": "Feed the rest token by token (shows the gap)",
                   "bfloat16": "Switch to bfloat16 (shows the gap)"}[fix], key="split_show_gap",
                  on_click=st.session_state.update, icon=":material/visibility:", type="primary",
                  kwargs={"step": {"split_mode": "step"}, "bfloat16": {"dtype": "bfloat16"}}[fix])
if not res.main.has_cache:
    st.stop()
with left:  # tiles: the unit in each label (absolute, relative to |x|, in ε, positions)
    normal = None
    if choice.invariant:  # the proof alone reads "identical": the normal run's gap goes beside it
        try:
            normal = run_view(VIEW, lm, cfg, settings=choice.settings.with_(invariant=False), prove=False,
                              name="split_normal", label="The same scenario with invariant mode off…")
        except Exception as e:  # noqa: BLE001
            show_error(e)
    tiles = split_figures.tiles(res, kvviz.machine_eps(lm.dtype), normal)
    cols = st.columns(2 if st.session_state.get("presenter") else 3)
    for i, (label, value, help_text) in enumerate(tiles):
        cols[i % len(cols)].metric(label, value, help=help_text)
with right:
    chart_box = st.container()  # the heatmap first, its view controls under it (the first screen shows the chart)
    v1, v2 = st.columns([2, 1])
    metric = v1.selectbox("Metric", list(HIDDEN_METRICS), index=2, key="split_metric",
                          format_func=plotting.METRIC_TITLES.get,
                          help="; ".join(f"{plotting.METRIC_TITLES[k]}: {v}" for k, v in HIDDEN_METRICS.items()))
    log = v2.toggle("Log colours", True, key="split_log", help="Colour the gaps on a log scale")
    # presenter mode at 1280×720: the whole map (its last layer, its token axis) in the first screen
    fit = PRESENTER_HEATMAP_PX if st.session_state.get("presenter") else None
    chart_box.plotly_chart(split_figures.split_heatmap(res, metric, log, height=fit), width="stretch",
                           key="split_heatmap")
st.plotly_chart(split_figures.layer_lines(res, metric, log), width="stretch", key="split_lines")

with st.expander("A/B: this view against one other setting, on one colour scale"):
    b = ab_run(VIEW, choice, lm, cfg, {"feed mode": ("mode", [m for m in ("chunk", "step") if m != mode])},
               "Runs the model once more with B's setting")
    if b is not None:
        show_ab(split_figures.ab_heatmaps(res, b.result, f"{b.label_a}: {res.verdict}",
                                          f"{b.label_b}: {b.result.verdict}", metric, log), "split",
                f"A largest |Δ| {res.main.max_abs:.4g}, B {b.result.main.max_abs:.4g}. Same colour scale on both "
                "maps; the third map is their difference.")

t1, t2, t3 = st.tabs(["Logits per position", "Last position: describe()", "Keys / values per layer"])
with t1:
    st.dataframe(split_figures.logits_frame(res), hide_index=True, width="stretch")
with t2:
    st.caption("pandas describe() of of the last compared position's logits without and with past.")
    st.dataframe(split_figures.describe_frame(res), width="stretch")
with t3:
    st.caption("Keys and values in the cache after the cached run vs the full forward's (pad positions excluded).")
    st.dataframe(split_figures.kv_frame(res), hide_index=True, width="stretch")
bisect_key = repr(cfg.__dict__) + choice.key
# open once asked: the rerun the button starts must not fold the answer away
with st.expander("Where does it start? (bisector)", expanded=st.session_state.get("split_bisect_for") == bisect_key):
    st.caption("Hooks every module in the full forward and the cached run and names the first whose output differs "
               "for the compared tokens. In invariant mode, a surviving gap starts there.")
    st.button("Find the first differing module", key="split_bisect",
              on_click=lambda k=bisect_key: st.session_state.__setitem__("split_bisect_for", k))
    if st.session_state.get("split_bisect_for") == bisect_key:
        from kvviz.views.bisect.run import BisectConfig
        from kvviz.core.naming import module_row

        try:
            b = run_view("bisect", lm, BisectConfig(**cfg.__dict__), label="Bisecting…")
        except Exception as e:  # noqa: BLE001
            show_error(e)
        else:
            st.markdown(b.explanation)
            away = rounding_away_note(res.main.hidden["max_abs"], b.first.name if b.first else None)
            if away:
                st.info(away, icon=":material/info:")
            st.dataframe([{"layer": module_row(g.name), "module": g.name, "kind": g.kind, "max |Δ|": g.max_abs}
                          for g in b.modules], hide_index=True, width="stretch")
for note in res.notes:
    st.caption(f"ℹ️ {note}")
exports(res, "split", lm)
st.caption(f"Computed in {res.elapsed_s:.2f} s on {res.settings.device}.")
