"""Page: the Lesson - precision-error accumulation in eight steps, each one live computation (kvviz/teach/lesson.py), a
"predict, then reveal" question and its figure (kvviz/teach/lesson_figures.py); the whole lesson as one HTML handout."""
import streamlit as st

from kvviz.teach import lesson
from kvviz.core.dtypes import DTYPE_NAMES
from kvviz.teach.lesson_figures import figure, handout_html
from kvviz.teach.exercises import ANSWERS, BY_KEY, run_exercise
from kvviz.views.split.figures import split_heatmap
from pages.common import page
from pages.runner import progress_bar, run_task, show_error

SHORT = {1: "1 · Floats", 2: "2 · Sums", 3: "3 · One row", 4: "4 · One layer", 5: "5 · All layers",
         6: "6 · A word flips", 7: "7 · The referee", 8: "8 · A bug", 9: "Exercises: find the bug"}
LOW = ("float32", "float16", "bfloat16")

choice, _ = page("Lesson: rounding or a bug?",
                 "Why a KV cache changes a model's numbers, in eight short steps a class can follow alone: each step "
                 "computes something live (on the sidebar's model), asks you to predict the result, then shows it "
                 "with a figure and one paragraph of why.", needs_model=False)
ss = st.session_state


def models():
    """The lesson's model in any dtype (loaded once each: kvviz keeps loaded models)."""
    return lesson.model_loader(choice.model_spec, choice.device, choice.attn, choice.trust_remote_code)


def go(step: int) -> None:
    ss["lesson_step"] = SHORT[min(max(step, 1), len(SHORT))]


ss.setdefault("lesson_step", SHORT[1])
st.radio("Step", list(SHORT.values()), key="lesson_step", horizontal=True, label_visibility="collapsed")
step = next(k for k, v in SHORT.items() if v == ss["lesson_step"])


def exercises_page() -> None:
    """Find the bug: a scenario with its settings hidden; the gap, the float64 rerun on request, the student's
    verdict checked against kvviz's, then what was hidden."""
    st.subheader("Exercises: find the bug")
    st.caption("Each exercise runs a cached-vs-full comparison whose settings are hidden. Look at the gap, rerun it "
               "in float64 if you like, and decide: precision (rounding) or logic (a bug). Steps 7 and 8 show how.")
    key = st.radio("Exercise", list(BY_KEY), format_func=lambda k: BY_KEY[k].title, horizontal=True,
                   key="lesson_ex")
    ex = BY_KEY[key]
    st.markdown(f"**{ex.title}.** {ex.story}")

    def compute():
        with progress_bar(f"{ex.title}: running the scenario…") as report:
            report(0.05, f"{ex.title}: running the scenario and its float64 rerun (a few seconds)…")
            return run_exercise(key, models())

    try:
        run = run_task(f"lesson_ex_{key}", key, compute, ignores=("dtype",))
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return
    c1, c2 = st.columns(2)
    c1.metric(f"largest relative gap ({ex.dtype})", f"{run.gap:.3g}")
    shown = f"_lesson_ex64_{key}"
    if ss.get(shown):
        c2.metric("the same scenario in float64", "0" if not run.float64_gap else f"{run.float64_gap:.3g}")
    else:
        c2.button("Rerun it in float64", key=f"lesson_ex64_{key}", icon=":material/science:",
                  on_click=lambda: ss.__setitem__(shown, True))
    st.plotly_chart(split_heatmap(run.result, "relative"), width="stretch", key=f"lesson_ex_fig_{key}")
    answer = st.radio("Your verdict", ANSWERS, index=None, horizontal=True, key=f"lesson_ex_answer_{key}",
                      format_func={"precision": "precision (rounding)", "logic": "logic (a bug)"}.get)
    if answer is not None:
        right, text = run.check(answer)
        (st.success if right else st.error)(text)


if step == 9:
    exercises_page()
    st.button("← Back to step 8", key="lesson_prev_ex", on_click=go, args=(8,))
    st.stop()
st.subheader(f"Step {step}: {lesson.TITLES[step]}")

# each step's few controls (a change reruns that step only)
options: dict = {}
if step == 1:
    c1, c2 = st.columns(2)
    options["value"] = c1.number_input("A number", value=0.1, format="%.10g", key="lesson_value")
    options["dtype"] = c2.selectbox("dtype", DTYPE_NAMES, index=DTYPE_NAMES.index("bfloat16"), key="lesson_dtype1")
elif step == 2:
    c1, c2, c3 = st.columns(3)
    options["n"] = int(c1.number_input("How many numbers", 2, 20000, 1000, key="lesson_n"))
    options["dtype"] = c2.selectbox("dtype", DTYPE_NAMES, index=DTYPE_NAMES.index("float32"), key="lesson_dtype2")
    options["seed"] = int(c3.number_input("Random seed", 0, 10_000, 0, key="lesson_seed"))
elif step == 4:
    c1, c2 = st.columns(2)
    options["dtype"] = c1.selectbox("dtype", LOW, index=2, key="lesson_dtype4")
    layer = int(c2.number_input("Layer (0: the middle layer with a gap entering it)", 0, 200, 0, key="lesson_layer"))
    options["layer"] = layer or None
elif step == 6:
    c1, c2 = st.columns([3, 1])
    options["prompt"] = c1.text_input("Prompt", lesson.CONSTRUCTED_PROMPT, key="lesson_prompt6",
                                      help=f"Fed to {lesson.CONSTRUCTED} in bfloat16, a tiny model built so that its "
                                           "cached and no-cache paths part at step 1 on every machine, whatever "
                                           "the prompt")
    options["n"] = int(c2.number_input("New tokens", 2, 64, 6, key="lesson_n6"))
elif step == 7:
    options["dtype"] = st.selectbox("dtype", LOW, index=0, key="lesson_dtype7")
elif step == 8:
    c1, c2 = st.columns(2)
    options["left_pad"] = int(c1.number_input("Pad tokens before the prompt", 1, 64, 3, key="lesson_pad"))
    options["dtype"] = c2.selectbox("dtype", LOW, index=0, key="lesson_dtype8")


def compute():
    with progress_bar(f"Step {step}: computing…") as report:
        report(0.05, f"Step {step}: loading the model and computing (a few seconds)…")
        return lesson.run_step(step, models(), **options)


try:
    res = run_task(f"lesson{step}", (step, options), compute, ignores=("dtype",))
except Exception as e:  # noqa: BLE001 - one line, the page keeps working
    show_error(e)
    st.stop()

st.markdown(f"**Predict.** {res.question}")
shown_key = f"_lesson_shown_{step}_{hash(res.question)}"
pred_label = st.radio("Your prediction", res.choices, index=None, key=f"lesson_pred_{step}_{hash(res.question)}",
                      on_change=lambda: ss.__setitem__(shown_key, True))
if not ss.get(shown_key):
    st.button("Reveal the answer", key=f"lesson_reveal_{step}", icon=":material/visibility:", type="primary",
              on_click=lambda: ss.__setitem__(shown_key, True))
else:
    picked = None if pred_label is None else res.choices.index(pred_label)
    graded = res.graded(picked)
    if graded:
        (st.success if res.is_right(picked) else st.info)(graded)
    if res.answer is not None:
        st.markdown(f"**Answer:** {res.choices[res.answer]}")
    st.markdown(res.reveal)
    if step == 1:
        s, e, m = res.data["bits"]
        st.code(f"sign {s} | exponent {e} | mantissa {m}", language=None)
    st.plotly_chart(figure(res), width="stretch", key=f"lesson_fig_{step}")
    st.markdown(f"**Why.** {res.explanation}")
    st.caption(f"Computed in {res.elapsed_s:.2f} s on this machine"
               + ("" if step in (1, 2) else f", with {choice.spec}") + ".")

p, _, n = st.columns([1, 3, 1])
if step == len(SHORT) - 1:
    n.button("Exercises →", key="lesson_next", on_click=go, args=(9,), type="primary")
if step > 1:
    p.button("← Previous step", key="lesson_prev", on_click=go, args=(step - 1,))
if step < len(SHORT) - 1:
    n.button("Next step →", key="lesson_next", on_click=go, args=(step + 1,), type="primary")

st.divider()
h1, h2 = st.columns([2, 1], vertical_alignment="center")
h1.markdown("**Handout**: the whole lesson as one HTML file that opens offline - every step with its question, then "
            "its answer, figure and explanation folded away until the student opens them (each step's current "
            "settings; steps not opened use their defaults; about a minute the first time).")
h2.button("Prepare the handout", key="lesson_handout", icon=":material/description:",
          on_click=lambda: ss.__setitem__("_lesson_make_handout", True))
if ss.pop("_lesson_make_handout", False):
    try:
        done = []
        with progress_bar("Preparing the handout…") as report:
            for k in lesson.STEPS:
                report((k - 1) / len(lesson.STEPS), f"Step {k} of {len(lesson.STEPS)}…")
                opts = options if k == step else {}
                done.append(run_task(f"lesson{k}", (k, opts), lambda k=k, opts=opts: lesson.run_step(
                    k, models(), **opts), ignores=("dtype",)))
        ss["_lesson_handout"] = handout_html(done, choice.spec)
    except Exception as e:  # noqa: BLE001
        show_error(e)
if ss.get("_lesson_handout"):
    h2.download_button("Download (HTML)", ss["_lesson_handout"], file_name="kvviz-lesson.html",
                       mime="text/html", key="lesson_handout_dl", icon=":material/download:")
