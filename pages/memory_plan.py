"""The memory plan of a page's run, drawn by pages.runner (not a page: app.py's navigation does not list it): one
caption, the estimate against what is free (the full plan on hover), or one error line naming what to lower. Nothing
is loaded to make the plan (kvviz.core.memory reads the model's files only)."""
from __future__ import annotations

from dataclasses import replace

import streamlit as st

from kvviz.core.memory import GB, MemoryPlan, Workload, plan_workload


def plan_for(choice, view: str, workload: Workload) -> MemoryPlan:
    """The plan of a page's run from the sidebar's ModelChoice, by the CLI's builder (plan_workload)."""
    if workload.attention == "auto" and getattr(choice, "attn", None):  # the sidebar's attention implementation
        workload = replace(workload, attention=str(choice.attn))
    return plan_workload(choice.spec, choice.dtype, choice.device, view, workload,
                         invariant=bool(getattr(choice, "invariant", False)))


def show_plan(choice, view: str, workload: Workload) -> MemoryPlan | None:
    """Draw the plan (a caption; an error line when it does not fit); None when no plan can be made."""
    try:
        plan = plan_for(choice, view, workload)
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

