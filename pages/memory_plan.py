"""The memory plan beside a page's Run button (not a page of its own: app.py's navigation does not list it).

    from pages.memory_plan import show_plan
    plan = show_plan(choice, view="split", prompt=prompt, left_pad=left_pad)
    run = st.button("Run", disabled=blocks_run(plan))

One caption: the estimate against what is free (the full plan on hover); a run that cannot fit gets one error
line naming what to lower, and `blocks_run(plan)` is True so the page can disable its Run button. Nothing is
loaded to make the plan (kvviz.memory reads the model's files only).
"""
from __future__ import annotations

import streamlit as st

from kvviz.memory import GB, MemoryPlan, plan_run, tokens_of_text


def plan_for(choice, view: str, prompt: str = "", new_tokens: int = 0, left_pad: int = 0, batch: int = 1,
             dtypes: tuple[str, ...] = (), tokens: int | None = None) -> MemoryPlan:
    """The plan of a page's run from the sidebar choice (kvviz's ModelChoice: spec, dtype, device)."""
    n = tokens if tokens is not None else tokens_of_text(choice.spec, prompt or "") + new_tokens + left_pad
    dtype = dtypes[0] if view == "dtypes" and dtypes else choice.dtype
    return plan_run(choice.spec, dtype, choice.device, view, max(n, 1), batch, dtypes)


def show_plan(choice, view: str, **workload) -> MemoryPlan | None:
    """Draw the plan (a caption; an error line when it does not fit); None when no plan can be made."""
    try:
        plan = plan_for(choice, view, **workload)
    except Exception as e:  # noqa: BLE001 - a bad model choice is reported by the run itself
        st.caption(f"Memory plan: not available ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})")
        return None
    free = "unknown" if plan.available is None else f"{plan.available / GB:.1f} GiB"
    text = (f"Memory: about {plan.total / GB:.2f} GiB of {free} free on {plan.device}"
            + (f" (float64 reference: {plan.reference})" if plan.reference not in ("none", "unknown") else ""))
    if plan.fits:
        st.caption(text, help="\n\n".join(plan.lines()))
    else:
        st.error("Cannot run: " + plan.refusal(), icon=":material/memory:")
    return plan


def blocks_run(plan: MemoryPlan | None) -> bool:
    """True when the plan says the run cannot fit (disable the Run button)."""
    return plan is not None and not plan.fits
