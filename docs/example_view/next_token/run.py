"""Config, run and result of the example view. Every model call goes through the execution seam (Executor), so the
run honours invariant mode, cache kinds and the float64 reference like every other view."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

from kvviz.core.errors import KvvizError
from kvviz.core.execution import ExecSettings, Executor, RunInfo
from kvviz.core.inputs import encode
from kvviz.core.protocol import DEFAULT_CONTEXT, RunContext


@dataclass(frozen=True)
class NextTokenConfig:
    """The prompt whose last token is fed through the cache of the rest. Its fields are the subcommand's options
    (`--prompt`) and a page's controls (`help`: the control's tooltip); ABOUT is what its page says to the user."""
    ABOUT: ClassVar[str] = (
        "Does the KV cache change the next word's scores? The prompt runs whole, then again with its last token fed "
        "through the cache of the rest; the chart shows the largest difference (0: the very same numbers). Without a "
        "float64 rerun, this example does not say whether a difference is rounding or a bug.")
    prompt: str = field(default="The cat sat on the", metadata={
        "help": "The text the model reads. Its last token is the one fed through the cache of the others."})

    def validate(self) -> None:
        if not self.prompt:
            raise KvvizError("the prompt is empty")


@dataclass
class NextTokenResult:
    settings: dict  # the run (model, dtype, device, attention, execution) and the prompt
    tokens: int
    max_abs: float  # max |Δ logit| at the last position, cached vs full
    same_argmax: bool
    verdict: str  # "identical" (bit for bit) or "gap" (not judged: no float64 reference, so neither precision nor logic)
    explanation: str

    def to_dict(self) -> dict:
        return asdict(self)


def run_next_token(lm, prompt: str, settings: ExecSettings | None = None) -> NextTokenResult:
    ids = torch.tensor([encode(lm, prompt)], device=lm.device)
    ex = Executor(lm, settings)
    with ex.session():
        full = ex.forward(ids, hidden=False).logits[0, -1]
        past = ex.forward(ids[:, :-1], hidden=False).past_key_values
        cached = ex.forward(ids[:, -1:], cache=past, hidden=False).logits[0, -1]
    gap = float((full.double() - cached.double()).abs().max())
    same = bool(full.argmax() == cached.argmax())
    verdict = "identical" if gap == 0 else "gap"
    text = (f"The last of {ids.shape[1]} tokens fed through the cache gives the full forward's logits "
            + ("bit for bit." if gap == 0 else f"within {gap:.3g} (next token {'the same' if same else 'changes'}); "
               "this example runs no float64 reference, so it does not say whether that is precision or logic."))
    run = RunInfo.of(lm, ex.settings).to_dict()
    return NextTokenResult({**run, "prompt": prompt}, int(ids.shape[1]), gap, same, verdict, text)


REFUSES = {"prove": "it runs no proof rerun"}  # what it cannot honour: refused in one line, never ignored


def run(lm, config: NextTokenConfig, ctx: RunContext = DEFAULT_CONTEXT) -> NextTokenResult:
    """The view's run: one signature for every view (kvviz.core.protocol)."""
    with ctx.running(REFUSES):
        return run_next_token(lm, config.prompt, ctx.settings)
