"""Streamlit AppTest: the pages run, react to their controls, and show bad input as one message."""
import json

import pytest
from streamlit.testing.v1 import AppTest

import kvviz

from apptest import app, start  # tests/apptest.py: the one AppTest start (other test modules import it from here)
from conftest import ROOT

pytestmark = pytest.mark.app


def alerts(at) -> str:
    return " | ".join(e.value for e in list(at.error) + list(at.warning) + list(at.info) + list(at.success))


def count_calls(monkeypatch, module, name: str) -> list:
    """Replace module.name by a wrapper that records each call (pages look the function up on every run)."""
    calls = []
    real = getattr(module, name)

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def count_runs(monkeypatch):
    import kvviz.views.split.run as split_run  # the split view's run (the page runs it through pages.runner.run_view)

    return count_calls(monkeypatch, split_run, "run_split")


def test_home_page_runs():
    at = app()
    at.run()
    assert not at.exception
    assert "KV cache" in at.title[0].value


def test_split_page_controls_and_view_only_changes(count_runs):
    at = start("pages/split.py")
    assert "Verdict:" in alerts(at)
    assert len(at.get("plotly_chart")) == 2
    assert len(count_runs) == 1
    # changing the split reruns the comparison
    at.slider(key="split_k_slider").set_value(5).run()
    assert not at.exception and len(count_runs) == 2
    # k typed as a number moves the slider and runs that split
    at.number_input(key="split_k_typed").set_value(3).run()
    assert not at.exception and at.slider(key="split_k_slider").value == 3 and len(count_runs) == 3
    assert "3 cached" in " ".join(c.value for c in at.caption)
    at.slider(key="split_k_slider").set_value(6).run()
    assert at.number_input(key="split_k_typed").value == 6 and len(count_runs) == 4
    # changing only the metric or the colour scale re-renders without running the model
    at.selectbox(key="split_metric").set_value("eps_units").run()
    at.toggle(key="split_log").set_value(False).run()
    assert not at.exception and len(count_runs) == 4
    assert len(at.get("plotly_chart")) == 2
    # a left-padded prompt with omitted position ids on gpt2: the page says logic
    at.number_input(key="split_pad").set_value(3).run()
    at.radio(key="split_pos").set_value("omit").run()
    assert "Verdict: logic" in alerts(at)
    # dtype in the shared sidebar
    at.selectbox(key="dtype").set_value("bfloat16").run()
    assert not at.exception and "Verdict:" in alerts(at)


def test_split_page_bad_inputs_keep_the_app_working():
    at = start("pages/split.py")
    at.text_area(key="split_prompt").input("   ").run()
    assert not at.exception
    assert "empty" in alerts(at)
    at.text_area(key="split_prompt").input("x" * 700).run()  # longer than tiny gpt2's 512 positions
    assert not at.exception and "longer than the model's context" in alerts(at)
    at.text_area(key="split_prompt").input("Back to a normal prompt").run()
    assert not at.exception and "Verdict:" in alerts(at)
    # an unknown model: one message, the page stops cleanly
    at.selectbox(key="model_preset").set_value("other…").run()
    at.text_input(key="model_other").input("/no/such/model").run()
    assert not at.exception and "not found" in alerts(at)
    at.selectbox(key="model_preset").set_value("tiny:llama").run()
    assert not at.exception and "Verdict:" in alerts(at)


def test_split_page_roberta_says_no_cache():
    at = start("pages/split.py", model="tiny:roberta")
    assert not at.exception
    text = alerts(at)
    assert "Verdict: logic" in text and "no cache" in text
    assert len(at.get("plotly_chart")) == 0


def test_greedy_page_decodes_and_views_do_not_rerun(monkeypatch):
    import kvviz.views.greedy.run as g

    calls = count_calls(monkeypatch, g, "run_greedy")
    at = start("pages/greedy.py")
    at.number_input(key="greedy_n").set_value(8)
    at.number_input(key="greedy_pad").set_value(3)
    at.multiselect(key="greedy_paths").set_value(["no_cache", "cache", "user_loop"])
    at.run()
    assert not at.exception
    text = alerts(at)
    assert "Verdict: logic" in text  # the user loop with left padding parts from the others
    assert len(at.get("plotly_chart")) == 2
    n_calls = len(calls)
    assert n_calls == 2  # the default settings, then ours
    at.toggle(key="greedy_log").set_value(False).run()
    at.selectbox(key="greedy_pair").set_value("cache vs user_loop").run()
    assert not at.exception and len(calls) == n_calls
    # bad input: 0 new tokens is refused by the widget; an empty prompt is a message
    at.text_area(key="greedy_prompt").input(" ").run()
    assert not at.exception and "empty" in alerts(at)


def test_dtypes_page_set_and_views():
    at = start("pages/dtypes.py")
    assert not at.exception
    assert len(at.get("plotly_chart")) == 1
    at.radio(key="dtypes_source").set_value("built-in set").run()
    at.number_input(key="dtypes_limit").set_value(4).run()
    assert not at.exception and len(at.get("plotly_chart")) == 1
    store = at.session_state["_results_dtypes"]
    n = len(store)
    at.radio(key="dtypes_metric").set_value("eps_units").run()
    at.radio(key="dtypes_how").set_value("max").run()
    assert not at.exception and len(at.session_state["_results_dtypes"]) == n  # views did not recompute


def test_padding_and_reuse_pages():
    at = start("pages/padding.py")
    assert not at.exception and len(at.get("plotly_chart")) == 1
    at.number_input(key="padding_pad").set_value(2).run()
    assert not at.exception
    at.text_area(key="padding_prompt").input("").run()
    assert not at.exception and "empty" in alerts(at)
    at = start("pages/reuse.py", model="tiny:llama")
    assert not at.exception
    text = alerts(at)
    assert "reused" in text and "logic" in text
    at.text_area(key="reuse_conts").input("   ").run()
    assert not at.exception and "at least one continuation" in alerts(at)


def test_a_folder_model_typed_into_other(tmp_path, count_runs):
    """The route users take with their own model: a folder typed into "other…", through the Split point page
    with a real gap (so the float64 rerun loads the folder again, from the parsed spec)."""
    import shutil

    from kvviz.models.loading import tiny_folder

    folder = tmp_path / "my-model"
    shutil.copytree(tiny_folder("llama"), folder, ignore=shutil.ignore_patterns("kvviz-tiny.json"))
    at = start("pages/split.py", model="other…", model_other=str(folder), split_pad=3, split_pos="omit")
    text = alerts(at)
    assert "Verdict: logic" in text and "position ids were omitted" in text
    assert "model path not found" not in text and len(count_runs) == 1
    assert any("local model folder my-model" in c.value for c in at.sidebar.caption)


def test_invariant_mode_from_the_sidebar_proves_the_verdict():
    at = start("pages/split.py", model="tiny:llama", dtype="bfloat16", invariant=True, split_mode="step")
    text = alerts(at)
    assert "Verdict: identical" in text and "the gap is exactly 0" in text


def test_the_dtype_sweep_ignores_the_sidebar_dtype():
    at = start("pages/dtypes.py", model="tiny:llama")
    n = len(at.session_state["_results_dtypes"])
    at.sidebar.selectbox(key="dtype").set_value("bfloat16").run()
    assert not at.exception and len(at.session_state["_results_dtypes"]) == n  # no new result: not rerun


def test_loading_trap_page():
    at = start("pages/loading_trap.py", model="tiny:llama", loading_trap_n=4)
    assert "different models" in alerts(at).lower() or "two different models" in alerts(at)
    assert len(at.text) == 2


def test_backends_page_runs_on_click_and_views_do_not_rerun():
    at = start("pages/matrix.py", model="tiny:llama", matrix_n=3, matrix_rep=1)
    assert not at.exception and len(at.get("plotly_chart")) == 0  # nothing runs before the click
    assert "_results_matrix" not in at.session_state
    at.button(key="matrix_run").click().run()
    assert not at.exception, at.exception
    assert len(at.get("plotly_chart")) == 2
    n = len(at.session_state["_results_matrix"])
    at.selectbox(key="matrix_cell").set_value(at.selectbox(key="matrix_cell").options[-1]).run()
    assert not at.exception and len(at.session_state["_results_matrix"]) == n  # picking a cell reruns nothing


def test_sliding_window_preset_and_bisector_buttons():
    at = start("pages/matrix.py", model="tiny:mistral")
    at.button(key="matrix_preset").click().run()
    assert not at.exception and at.text_area(key="matrix_batch").value  # the long companion prompt is filled in
    assert at.number_input(key="matrix_n").value > 8  # past the window of 8
    at = start("pages/matrix.py", model="tiny:llama")
    at.button(key="matrix_preset").click().run()
    assert "no sliding window" in alerts(at)
    at = start("pages/split.py", model="tiny:llama", split_pad=3, split_pos="omit", invariant=True)
    at.button(key="split_bisect").click().run()
    assert not at.exception and any("rotary" in m.value for m in at.markdown)


def test_kv_cache_page_saves_loads_and_sizes():
    from kvviz.views.cache.run import save_cache_bytes

    at = start("pages/cache.py", model="tiny:gemma2", cache_tokens=40)
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["formula"] == metrics["measured (live cache)"]
    labels = [b.label for b in at.get("download_button")]
    assert labels[0].startswith("Download the cache") and labels[1:] == ["Result (JSON)", "Report (HTML)"]
    assert len(at.get("plotly_chart")) == 1
    data, _ = save_cache_bytes(kvviz.load_model("tiny:gemma2", "float32", "auto"), "The capital of France is")
    assert data[8:9] == b"{"


def test_cache_safety_page():
    at = start("pages/check.py", model="tiny:roberta")
    assert "UNSAFE" in alerts(at)
    at = start("pages/check.py", model="tiny:llama")
    assert "SAFE" in alerts(at) and "UNSAFE" not in alerts(at)


def test_every_page_offers_its_exports():
    """One app session through the eight pages (a switch per page, not a fresh app and its Home run each)."""
    repro = ("split", "greedy", "padding", "reuse", "dtypes", "loading_trap", "quant", "check")
    at = app()
    at.session_state["model_preset"] = "tiny:llama"
    at.run()
    for path, state in [("split", {}), ("greedy", {"greedy_n": 3}), ("padding", {}),
                        ("reuse", {"reuse_n": 2}), ("dtypes", {"dtypes_dtypes": ["bfloat16"]}),
                        ("loading_trap", {"loading_trap_n": 3}), ("quant", {"quant_n": 3}), ("check", {})]:
        for k, v in state.items():
            at.session_state[k] = v
        at.switch_page(f"pages/{path}.py").run()
        assert not at.exception, (path, at.exception)
        labels = [b.label for b in at.get("download_button")]
        assert "Result (JSON)" in labels and "Report (HTML)" in labels, (path, labels)
        assert ("Repro script (Python)" in labels) == (path in repro), (path, labels)


@pytest.mark.parametrize("key, expect", [
    ("tie", "Verdict: precision"), ("flip", "Verdict: precision"), ("padding", "Verdict: logic"), ("newonly", "Verdict: logic"),
    ("bidirectional", "Verdict: logic"), ("proof", "gap is exactly 0"),
])
def test_home_presets_show_their_effect(key, expect):
    at = app()
    at.run()
    at.button(key=f"preset_{key}").click().run()
    assert not at.exception, at.exception
    assert expect in alerts(at)
    if key == "tie":  # the 16-bit tie flips "b" to "a" at the first step
        assert "'a'" in alerts(at) and "'b'" in alerts(at)
    if key == "flip":  # no cache and the cache part at step 1: "a" against "b"
        assert "At step 1 no cache (full forward each step) chose 'a'" in alerts(at)


def test_home_presets_for_the_sweep_and_the_window():
    at = app()
    at.run()
    at.button(key="preset_window").click().run()
    assert not at.exception and at.text_area(key="matrix_batch").value and at.number_input(key="matrix_n").value > 8
    at = app()
    at.run()
    at.button(key="preset_layers").click().run()
    assert not at.exception and len(at.get("plotly_chart")) >= 1


def test_guide_and_glossary_pages():
    at = app()
    at.run()
    at.switch_page("pages/guide.py").run()
    assert not at.exception and any("float64" in m.value for m in at.markdown)
    at.switch_page("pages/glossary.py").run()
    assert not at.exception and any("Machine epsilon" in m.value for m in at.markdown)


def test_page_settings_survive_a_page_switch():
    at = start("pages/split.py", model="tiny:llama")
    at.radio(key="split_mode").set_value("step").run()
    at.number_input(key="split_pad").set_value(3).run()
    at.switch_page("pages/greedy.py").run()
    assert not at.exception
    at.switch_page("pages/split.py").run()
    assert at.radio(key="split_mode").value == "step" and at.number_input(key="split_pad").value == 3
    assert at.query_params["split_mode"] == ['"step"'] or at.query_params["split_mode"] == '"step"'


def test_a_link_with_a_pages_other_prefix_opens_its_controls():
    """Links saved with the Serving page's other prefix (sv_) still set its controls (serving_)."""
    at = app()
    at.query_params.update({"model_preset": '"tiny:llama"', "sv_runs": "1", "sv_tokens": "2", "sv_limit": "2"})
    at.run()
    at.switch_page("pages/serving.py").run()
    assert not at.exception, at.exception
    assert at.number_input(key="serving_runs").value == 1 and at.number_input(key="serving_tokens").value == 2
    assert "serving_runs" in at.query_params and "sv_runs" not in at.query_params


def open_url(at: AppTest, url_path: str) -> AppTest:
    """Run the page a browser asking for /<url_path> gets (AppTest itself opens pages by file; Streamlit finds a
    page by the hash of its URL path)."""
    from streamlit.util import calc_hash

    at._page_hash = calc_hash(url_path)
    return at.run()


def test_every_view_page_is_at_its_views_name_and_its_older_urls_are_kept():
    """The navigation registers each view's page at its view's name (its folder) and each older URL of it (its
    Page(url_aliases=...)) as a hidden page of its own, so that no saved link lands on "page not found"."""
    from pathlib import Path

    from kvviz import views

    at = app()
    at.run()
    registered = {info["url_pathname"]: info.get("script_path", "") for info in at._registered_pages.values()}
    pages = [v.page for v in views.all_views() if v.page]
    assert len(pages) == 13  # the twelve views and the logit lens (generic page)
    for page in pages:
        assert Path(registered[page.url_path]) == ROOT / "pages" / f"{page.stem}.py", page.url_path
        for old in page.url_aliases:
            assert registered[old] == "", old  # a hidden forwarding page, not a second copy of the script
    assert {"split", "greedy", "matrix", "cache", "check", "split_point", "backends", "kv_cache"} <= set(registered)


def test_an_older_page_url_opens_the_page_at_its_own_url_with_the_links_settings():
    from streamlit.util import calc_hash

    at = app()
    at.query_params.update({"model_preset": '"tiny:gpt2"', "split_mode": '"step"', "split_pad": "3"})
    open_url(at, "split_point")  # a link saved before the page was at /split
    assert not at.exception, at.exception
    assert at._finished_page_script_hash == calc_hash("split") and at.title[0].value == "Split point"
    assert at.radio(key="split_mode").value == "step" and at.number_input(key="split_pad").value == 3
    assert at.query_params["split_pad"] in ("3", ["3"])  # the page's own URL carries the link's settings on
    # an older URL and an older settings prefix together: /kv_cache?kv_tokens=40 is the cache page with 40 tokens
    at = app()
    at.query_params.update({"model_preset": '"tiny:gpt2"', "kv_tokens": "40"})
    open_url(at, "kv_cache")
    assert not at.exception and at._finished_page_script_hash == calc_hash("cache")
    assert at.number_input(key="cache_tokens").value == 40
    open_url(at, "cache")  # and the page's own URL
    assert not at.exception and at.title[0].value == "KV cache" and at.session_state["_page"] == "cache"


def test_a_link_opens_the_exact_view_and_bad_parameters_fall_back():
    at = app()
    at.query_params.update({"model_preset": '"tiny:gpt2"', "split_mode": '"step"', "split_pad": "3",
                            "split_pos": '"omit"', "split_mask": "{broken"})
    at.run()
    at.switch_page("pages/split.py").run()
    assert not at.exception, at.exception
    assert at.radio(key="split_mode").value == "step" and at.radio(key="split_pos").value == "omit"
    assert at.radio(key="split_mask").value == "full"  # the unreadable one: its default
    text = alerts(at)
    assert "Verdict: logic" in text and "split_mask" in text and "could not be read" in text


def _opened_link(page: str, params: dict):
    """The app opened from a link with these query parameters (on a tiny model), on pages/<page>.py, run without
    an exception."""
    at = app()
    at.query_params.update({"model_preset": '"tiny:gpt2"', **params})
    at.run()
    at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, at.exception
    return at


def test_a_link_value_of_the_wrong_kind_falls_back_instead_of_raising():
    # readable JSON of another kind than the control holds: a number box given text, a text area a number, toggles
    # (page, A/B, sidebar) a string, a number box null; each would raise in the widget
    bad = {"split_pad": '"abc"', "split_prompt": "42", "split_log": '"yes"', "split_ab_on": '"x"',
           "presenter": '"x"', "invariant": '"x"'}
    at = _opened_link("split", {"split_mode": '"step"', **bad})
    text = alerts(at)
    assert "could not be read" in text and all(k in text for k in bad)
    assert at.radio(key="split_mode").value == "step"  # the readable one still applies
    assert at.number_input(key="split_pad").value == 0 and len(at.get("plotly_chart")) == 2
    at = _opened_link("greedy", {"greedy_n": "null", "greedy_fast": "1"})
    assert "greedy_n" in alerts(at) and "greedy_fast" in alerts(at) and len(at.get("plotly_chart")) == 2


def test_a_link_sidebar_choice_outside_its_options_gets_the_default_and_says_so():
    # left to the selectbox, dtype=float8 became its first option (float64) without a word
    at = _opened_link("split", {"dtype": '"float8"', "device": '"tpu"', "attn": '"magic"', "devices": '"many"'})
    assert at.selectbox(key="dtype").value == "float32" and at.selectbox(key="attn").value == "auto"
    assert at.selectbox(key="device").value == "auto" and at.selectbox(key="devices").value == "one device"
    text = alerts(at)
    assert "could not be read" in text and all(k in text for k in ("dtype", "device", "attn", "devices"))
    assert "float32" in text and len(at.get("plotly_chart")) == 2  # the run is float32


def test_every_typed_control_has_a_kind_for_links():
    from pages.state import fits_control

    assert not fits_control("split_pad", "abc") and fits_control("split_pad", 3)
    assert not fits_control("greedy_prompt", 42) and fits_control("greedy_prompt", "Hi")
    assert not fits_control("presenter", "x") and fits_control("presenter", True)
    assert not fits_control("dtypes_dtypes", "float16") and fits_control("dtypes_dtypes", ["float16"])
    assert not fits_control("serving_ab_on", 1) and not fits_control("model_other", 5)
    assert fits_control("split_mode", 5)  # a radio: Streamlit puts a value outside its options back itself


def test_split_ab_runs_b_once_on_a_shared_scale_and_views_do_not_rerun(count_runs):
    at = start("pages/split.py", model="tiny:llama")
    assert len(count_runs) == 1 and len(at.get("plotly_chart")) == 2
    at.selectbox(key="split_ab_what").set_value("feed mode").run()
    assert len(count_runs) == 1  # choosing what B changes runs nothing yet
    at.toggle(key="split_ab_on").set_value(True).run()
    assert not at.exception, at.exception
    assert len(count_runs) == 2
    charts = at.get("plotly_chart")
    assert len(charts) == 5  # main map and lines, then A, B and |B − A|
    import json

    specs = [json.loads(c.proto.spec) for c in charts[2:4]]
    scales = [[(t.get("zmin"), t.get("zmax")) for t in s["data"] if t["type"] == "heatmap" and "zmin" in t]
              for s in specs]
    assert scales[0] and scales[0] == scales[1]  # A and B share one colour scale
    assert "A — feed mode = chunk" in specs[0]["layout"]["title"]["text"]
    assert "B — feed mode = step" in specs[1]["layout"]["title"]["text"]
    # a view-only change redraws A/B from the stored results
    at.selectbox(key="split_metric").set_value("max_abs").run()
    assert not at.exception and len(count_runs) == 2 and len(at.get("plotly_chart")) == 5


def test_stop_leaves_the_page_usable_and_run_again_restarts(count_runs):
    at = start("pages/split.py")
    assert len(count_runs) == 1
    # what the Stop button's callback records when clicked during a run (the click itself interrupts the run)
    at.session_state["_stop_requested"] = True
    at.slider(key="split_k_slider").set_value(5).run()
    assert not at.exception, at.exception
    assert len(count_runs) == 1 and "Stopped" in alerts(at)
    assert at.text_area(key="split_prompt").value  # controls are still there
    at.button(key="_run_again_split").click().run()
    assert not at.exception and len(count_runs) == 2 and "Verdict:" in alerts(at)
    # a stopped run stays stopped only for its own inputs
    at.session_state["_stop_requested"] = True
    at.slider(key="split_k_slider").set_value(4).run()
    assert len(count_runs) == 2
    at.slider(key="split_k_slider").set_value(3).run()
    assert len(count_runs) == 3 and "Stopped" not in alerts(at)


def test_progress_reports_time_left(monkeypatch):
    import pages.runner as common

    shown = []
    times = iter([0.0, 2.0, 4.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(times))

    class Bar:
        def progress(self, frac, text):
            shown.append(text)

    class Box:
        def container(self):
            import contextlib

            return contextlib.nullcontext()

        def empty(self):
            pass

    monkeypatch.setattr(common.st, "empty", lambda: Box())
    monkeypatch.setattr(common.st, "progress", lambda *a, **k: Bar())
    monkeypatch.setattr(common.st, "button", lambda *a, **k: False)
    with common.progress_bar("Working…") as report:
        report(0.25, "step 1")  # 2 s for a quarter: 6 s left
        report(0.5, "step 2, about 3 s left")  # the library's own estimate wins
    assert shown == ["step 1 — about 6 s left", "step 2, about 3 s left"]


def test_greedy_ab_runs_b_once_on_a_shared_scale():
    """A: positions auto, B: positions omitted with left padding (a logic gap on any machine): both maps share B's
    colour range, and view-only changes do not rerun B."""
    at = start("pages/greedy.py", model="tiny:llama", greedy_n=5, greedy_pad=2)
    at.selectbox(key="greedy_ab_what").set_value("position ids (cache path)").run()
    at.toggle(key="greedy_ab_on").set_value(True).run()
    assert not at.exception, at.exception
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    ab = {f["layout"]["title"]["text"][0]: f for f in figs
          if f["layout"].get("title", {}).get("text", "").startswith(("A —", "B —"))}
    assert set(ab) == {"A", "B"} and "position ids (cache path) = omit" in ab["B"]["layout"]["title"]["text"]
    za, zb = ab["A"]["data"][0], ab["B"]["data"][0]
    assert zb["zmax"] > -3  # the logic gap: relative gaps far above rounding
    assert (za["zmin"], za["zmax"]) == (zb["zmin"], zb["zmax"])  # one shared colour scale
    assert any(f["layout"].get("title", {}).get("text", "").startswith("|B − A|") for f in figs)


def test_padding_page_without_padding_and_its_ab():
    at = start("pages/padding.py", model="tiny:llama", padding_pad=0)
    grid = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert grid["data"][0]["y"] == ["alone", "in a batch"]  # no "left-padded" row at padding 0
    at.selectbox(key="padding_ab_what").set_value("invariant mode").run()
    at.toggle(key="padding_ab_on").set_value(True).run()
    assert not at.exception, at.exception
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert "B — invariant mode = on" in titles and "|B − A| of the relative gap" in titles


def test_dtypes_and_reuse_ab():
    at = start("pages/dtypes.py", model="tiny:llama", dtypes_dtypes=["bfloat16"])
    at.selectbox(key="dtypes_ab_what").set_value("feed mode").run()
    at.toggle(key="dtypes_ab_on").set_value(True).run()
    assert not at.exception, at.exception
    figs = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec)
            for c in at.get("plotly_chart")}
    a = next(f for t, f in figs.items() if t.startswith("A —"))
    b = next(f for t, f in figs.items() if t.startswith("B — feed mode = step"))
    assert a["layout"]["yaxis"]["range"] == b["layout"]["yaxis"]["range"]  # one scale for A and B
    assert any(t.startswith("|B − A|") for t in figs)
    at = start("pages/reuse.py", model="tiny:llama", reuse_n=2)
    at.selectbox(key="reuse_ab_what").set_value("dtype").run()
    at.selectbox(key="reuse_ab_dtype").set_value("bfloat16").run()
    at.toggle(key="reuse_ab_on").set_value(True).run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert list(table.columns[:4]) == ["continuation", "way", "A verdict", "B verdict"]
    from pages.defaults import DEFAULTS

    n_conts = len(DEFAULTS["reuse"]["continuations"])  # the page's default continuations, one row per way each
    assert set(table["way"]) == {"fresh", "deepcopy", "reused"} and len(table) == 3 * n_conts and n_conts >= 2


def test_a_scenario_is_marked_and_leaving_it_restores_the_defaults():
    at = app()
    at.run()
    at.button(key="preset_padding").click().run()
    assert not at.exception, at.exception
    assert "Verdict: logic" in alerts(at) and "Scenario: Left padding without position ids" in alerts(at)
    assert at.number_input(key="split_pad").value == 4 and at.radio(key="split_pos").value == "omit"
    assert at.query_params["split_pad"] in ("4", ["4"])  # the URL says the scenario's settings at once
    # another model: the scenario's controls go back to their defaults, the banner goes
    at.selectbox(key="model_preset").set_value("tiny:gpt2").run()
    assert not at.exception, at.exception
    assert at.number_input(key="split_pad").value == 0 and at.radio(key="split_pos").value == "auto"
    assert "Verdict: logic" not in alerts(at) and "Verdict:" in alerts(at) and "Scenario:" not in alerts(at)
    assert "split_pad" not in at.query_params
    # another page and back: the scenario's model and controls are gone too
    at.switch_page("pages/home.py").run()
    at.button(key="preset_newonly").click().run()
    assert at.radio(key="split_mask").value == "new-only" and at.session_state["model_preset"] == "tiny:llama"
    at.switch_page("pages/guide.py").run()
    assert at.session_state["model_preset"] == "default"
    at.session_state["model_preset"] = "tiny:gpt2"  # (the default model is for slow tests)
    at.switch_page("pages/split.py").run()
    assert not at.exception and at.radio(key="split_mask").value == "full" and "Verdict: logic" not in alerts(at)


def test_reset_to_defaults_on_a_page():
    at = start("pages/split.py", model="tiny:llama")
    at.number_input(key="split_pad").set_value(3).run()
    at.radio(key="split_pos").set_value("omit").run()
    at.selectbox(key="dtype").set_value("bfloat16").run()
    assert "Verdict: logic" in alerts(at)
    at.button(key="_reset_split").click().run()
    assert not at.exception, at.exception
    assert at.number_input(key="split_pad").value == 0 and at.radio(key="split_pos").value == "auto"
    assert at.selectbox(key="dtype").value == "float32" and at.session_state["model_preset"] == "tiny:llama"
    assert "Verdict: logic" not in alerts(at) and "split_pos" not in at.query_params


def test_slider_and_box_agree_after_a_failed_load_and_the_old_message_goes():
    at = start("pages/split.py")
    at.number_input(key="split_k_typed").set_value(6).run()
    assert at.slider(key="split_k_slider").value == 6
    at.selectbox(key="model_preset").set_value("other…").run()
    at.text_input(key="model_other").input("/no/such/model.gguf").run()
    assert not at.exception and "not found" in alerts(at)
    at.selectbox(key="model_preset").set_value("tiny:gpt2").run()
    assert not at.exception, at.exception
    assert at.slider(key="split_k_slider").value == 6 and at.number_input(key="split_k_typed").value == 6
    assert "6 cached" in " ".join(c.value for c in at.caption)
    assert "not found" not in alerts(at)
    at.slider(key="split_k_slider").set_value(4).run()
    assert at.number_input(key="split_k_typed").value == 4 and at.query_params["split_k"] in ("4", ["4"])


def test_open_a_result_lists_the_prepared_meeting():
    import os
    from pathlib import Path

    from kvviz.teach.meeting import prepare

    prepare(["padding"], Path(os.environ["KVVIZ_CACHE"]) / "meeting")
    at = app()
    at.session_state["model_preset"] = "other…"
    at.session_state["model_other"] = "/nonexistent/model"  # nothing may load: the result is shown as it was
    at.run()
    at.switch_page("pages/open_result.py").run()
    at.selectbox(key="open_prepared").set_value("Left padding without position ids").run()
    assert not at.exception, at.exception
    assert "Verdict: logic" in alerts(at) and "nonexistent" not in alerts(at)


def test_home_prepares_the_meeting_with_its_button():
    import os
    from pathlib import Path

    out = Path(os.environ["KVVIZ_CACHE"]) / "meeting"
    for f in out.glob("*.json"):
        f.unlink()
    at = app()
    at.run()
    at.multiselect(key="meeting_keys").set_value(["layers", "bidirectional"]).run()
    at.button(key="meeting_run").click().run()
    assert not at.exception, at.exception
    assert "2 result(s) ready" in alerts(at) and "error" not in alerts(at).lower()
    assert sorted(f.name for f in out.glob("*.json")) == ["bidirectional.json", "layers.json"]
    assert (out / "meeting.html").read_text().count("<section") == 2


def test_a_run_with_my_folder_model_added_to_the_meeting_is_in_its_bundle(tmp_path):
    """A presenter's own run (their folder model, prompt padding and position ids) on Split point, "Add to the
    meeting", then Home's Prepare with no scenario: the bundle has that run as its own section, reopened from its
    JSON (verdict, settings, model = the folder); Open a result lists it; Remove takes it off the list."""
    import os
    import re
    import shutil
    from pathlib import Path

    from kvviz.io.export import open_result
    from kvviz.models.loading import tiny_folder
    from kvviz.teach.meeting import prepared

    folder = tmp_path / "my_model"  # an underscore: shown as typed in the list (markdown would eat it)
    shutil.copytree(tiny_folder("llama"), folder, ignore=shutil.ignore_patterns("kvviz-tiny.json"))
    at = start("pages/split.py", model="other…", model_other=str(folder), split_pad=3, split_pos="omit")
    assert "Verdict: logic" in alerts(at)
    at.button(key="meeting_add_split").click().run()
    assert not at.exception, at.exception
    assert any("Added to the meeting (1 run)" in c.value for c in at.caption)
    at.button(key="meeting_add_split").click().run()  # the same result twice is kept once
    assert any("Already in the meeting (1 run)" in c.value for c in at.caption)

    at.switch_page("pages/home.py").run()
    assert not at.exception, at.exception
    title = f"Split point: {folder} — logic"
    listed = [m.value for m in at.markdown if m.value.startswith("- ")]
    assert listed == ["- " + re.sub(r"([\\`*_\[\]<>#|~$])", r"\\\1", title)], listed
    at.multiselect(key="meeting_keys").set_value([]).run()  # no scenario: only the run, no model loaded for it
    at.button(key="meeting_run").click().run()
    assert not at.exception, at.exception
    assert "1 result(s) ready" in alerts(at) and "error" not in alerts(at).lower()

    out = Path(os.environ["KVVIZ_CACHE"]) / "meeting"
    html = (out / "meeting.html").read_text(encoding="utf-8")
    sections = dict(re.findall(r'<section id="s\d+"><h1>(.*?)</h1>(.*?)</section>', html, re.S))
    assert list(sections) == [title], list(sections)
    body = sections[title]
    assert "Verdict: logic." in body and "position ids were omitted" in body
    assert "reopened from its saved result (JSON), not rerun" in body and "plotly" in body
    assert f"<tr><th>model</th><td>{folder}</td></tr>" in body
    assert "<tr><th>left_pad</th><td>3</td></tr>" in body and "<tr><th>position_ids</th><td>omit</td></tr>" in body
    (name, path), = [(t, p) for t, p in prepared(out) if p.parent.name == "runs"]
    again = open_result(path.read_bytes())
    assert name == title and again.view == "split" and again.result.verdict == "logic"
    assert again.result.settings.model == str(folder) and again.header["model_fingerprint"]

    at.button(key="meeting_drop_1").click().run()
    assert not at.exception and not at.session_state["_meeting_runs"]
    assert not [m.value for m in at.markdown if m.value.startswith("- ")]
    assert at.button(key="meeting_run").disabled  # nothing left to prepare


def test_presenter_mode_headlines_the_verdict_from_its_proof_state():
    """Presenter mode shows the verdict in one sentence written from the result's verdict and proof state (the whole
    explanation one click away), on a split that parts in bfloat16 and is proved."""
    from kvviz.core.verdict import headline

    at = start("pages/split.py", model="tiny:llama", presenter=True, dtype="bfloat16")
    box = alerts(at)
    assert "Verdict: precision." in box, box
    assert headline("precision", True) in box, box
    assert not at.exception


@pytest.mark.app
def test_prove_it_is_rounding_shows_the_normal_runs_gap_beside():
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    at.run()
    at.button(key="preset_proof").click().run()
    at.run()
    assert not at.exception
    labels = {m.label: m.value for m in at.metric}
    assert "max |Δ|, normal run (absolute)" in labels and labels["max |Δ|, invariant mode (absolute)"] == "0"
    assert float(labels["max |Δ|, normal run (absolute)"]) > 0


@pytest.mark.app
def test_a_split_typed_past_the_prompt_shows_the_split_the_run_uses():
    from test_app import start

    at = start("pages/split.py", model="tiny:llama")
    box = at.number_input(key="split_k_typed")
    hi = int(at.slider(key="split_k_slider").max)
    assert box.max is None  # a browser keeps an out-of-range number in a box with a max (flagged, never sent)
    box.set_value(999).run()
    assert not at.exception
    assert at.number_input(key="split_k_typed").value == hi and at.slider(key="split_k_slider").value == hi
    assert f"{hi} cached" in " ".join(c.value for c in at.caption)
    assert f"k = 999 is outside 1–{hi}: using {hi}." in " ".join(c.value for c in at.caption)
    at.number_input(key="split_k_typed").set_value(0).run()
    assert at.slider(key="split_k_slider").value == 1 and "k = 0 is outside" in " ".join(c.value for c in at.caption)


@pytest.mark.app
def test_greedy_page_ab_without_both_paths_says_what_to_do():
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.session_state["model_preset"] = "tiny:llama"
    at.session_state["greedy_n"] = 3
    at.session_state["greedy_paths"] = ["no_cache", "generate"]
    at.run()
    at.switch_page("pages/greedy.py").run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert any("choose both paths" in i.value for i in at.info)
