"""The A/B row every view shares: change one setting, run B, draw A and B on one scale with |B − A| below."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import streamlit as st

import kvviz
from kvviz.core.execution import ExecSettings
from pages.runner import run_view, show_error

if TYPE_CHECKING:
    from pages.common import ModelChoice


@dataclass
class BRun:
    """B's side of an A/B row: what changed, B's result, and the two sides' labels ("dtype = float32")."""

    what: str
    other: str
    result: object
    label_a: str
    label_b: str


def ab_run(view, choice: "ModelChoice", lm, cfg, scenario: dict[str, tuple[str, list[str]]], help_text: str,
           exclude: tuple[str, ...] = (), **run) -> BRun | None:
    """The whole A/B row of a view's page: which setting to change (dtype, attention, invariant mode, and the view's
    own `scenario` settings, {label: (config field, B's choices)}: B runs `cfg` with that field replaced) and B's
    value, then B's run through the one runner (run "<view's run>_ab"; `run`: run_view's keywords). None until "Run
    B" is on, or when B failed (the error is shown in one line)."""
    ab = {"dtype": [d for d in kvviz.DTYPE_NAMES if d != choice.dtype],
          "attention": [a for a in kvviz.ATTN_CHOICES if a not in ("auto", choice.attn)],
          "invariant mode": ["off" if choice.invariant else "on"], **{k: v for k, (_, v) in scenario.items()}}
    ab = {k: v for k, v in ab.items() if k not in exclude}
    prefix = view.page.prefix.removesuffix("_")
    a1, a2, a3 = st.columns([2, 2, 1])
    what = a1.selectbox("Change", list(ab), key=f"{prefix}_ab_what")
    other = a2.selectbox("B", ab[what], key=f"{prefix}_ab_{what.split()[0]}")
    if not a3.toggle("Run B", False, key=f"{prefix}_ab_on", help=help_text) or other is None:
        return None
    lm_b, settings_b = lm, choice.settings
    if what == "invariant mode":
        settings_b = ExecSettings(invariant=other == "on")
    cfg_b = dataclasses.replace(cfg, **{scenario[what][0]: other}) if what in scenario else cfg
    try:  # B's model may not load here (e.g. flash_attention_2 on a CPU): one line, the page goes on
        if what == "dtype":
            lm_b = lm.twin(other)
        elif what == "attention":
            lm_b = kvviz.load_model(choice.model_spec, choice.dtype, choice.device, other,
                                    trust_remote_code=choice.trust_remote_code)
        res_b = run_view(view, lm_b, cfg_b, settings=settings_b, name=f"{view.run_names()[0]}_ab",
                         label=f"B: {what} = {other}…", **run)
    except Exception as e:  # noqa: BLE001 - one line, the page goes on
        show_error(e)
        return None
    label_a = {"dtype": choice.dtype, "attention": lm.attn_implementation if lm is not None else choice.attn,
               "invariant mode": "on" if choice.invariant else "off",
               **{k: str(getattr(cfg, f)) for k, (f, _) in scenario.items()}}[what]
    return BRun(what, other, res_b, f"{what} = {label_a}", f"{what} = {other}")


def show_ab(figs, prefix: str, caption: str, texts: tuple[str, str] | None = None, side_by_side: bool = True) -> None:
    """A and B side by side on their shared scale (one above the other for wide figures), |B − A| below (and each
    side's text under its map)."""
    b1, b2 = st.columns(2) if side_by_side else (st.container(), st.container())
    b1.plotly_chart(figs[0], width="stretch", key=f"{prefix}_ab_a")
    b2.plotly_chart(figs[1], width="stretch", key=f"{prefix}_ab_b")
    if texts is not None:
        b1.text(texts[0])
        b2.text(texts[1])
    st.plotly_chart(figs[2], width="stretch", key=f"{prefix}_ab_diff")
    st.caption(caption)
