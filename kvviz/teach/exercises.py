"""Find the bug: short exercises built from the Split point scenarios. Each runs a cached-vs-full comparison whose
settings are hidden from the student (some carry a logic error, some are only rounding); the student sees the gap,
may rerun it in float64, and decides: precision or logic. `check` grades the answer against kvviz's own verdict and
then names what was hidden. No Streamlit here."""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace

from ..core.errors import KvvizError
from .lesson import LESSON_PROMPT, Models
from ..core.inputs import encode
from ..core.protocol import RunContext
from ..views import split
from ..views.split.run import SplitConfig
from .. import views


@dataclass(frozen=True)
class Exercise:
    key: str
    title: str
    story: str  # what the student is told
    dtype: str
    prompt: str
    rest: int  # tokens fed after the cache
    mode: str  # "chunk" or "step"
    left_pad: int
    position_ids: str
    attention_mask: str
    hidden: str  # what was really done, told after the answer

    def config(self, n_tokens: int):
        return SplitConfig(prompt=self.prompt, split=max(1, n_tokens - self.rest), mode=self.mode,
                           left_pad=self.left_pad, position_ids=self.position_ids, attention_mask=self.attention_mask)


EXERCISES = (
    Exercise("server", "A. The chat server",
             "A colleague's server answers in bfloat16 with a KV cache. Cached vs full forward, the last tokens' hidden "
             "states differ. Bug or rounding?", "bfloat16", LESSON_PROMPT, 2, "step", 0, "auto", "full",
             "Nothing wrong: the last 2 tokens went through the cache one by one with correct mask and position ids. "
             "1-row products sum in another order than the full forward's; float64 closes the gap."),
    Exercise("batch", "B. The batch job",
             "A batch script pads short prompts on the left so they line up, prefills them, then feeds the rest "
             "through the cache. The numbers move. Bug or rounding?", "float32", LESSON_PROMPT, 4, "chunk", 4, "omit",
             "full",
             "A logic error: the script feeds the rest without position ids, so the model numbers the new tokens from "
             "the cache length, counting the 4 pads. float64 computes the same wrong positions and the gap stays."),
    Exercise("loop", "C. The hand-written loop",
             "Someone's decoding loop passes an attention mask for the new tokens only (the cache 'already knows' the "
             "past). The outputs drift. Bug or rounding?", "float32", LESSON_PROMPT, 3, "chunk", 0, "auto",
             "new-only",
             "A logic error: a mask that covers only the new tokens is lined up with the first (cached) positions, so "
             "the new tokens are blocked from the latest keys. transformers accepts it silently; float64 keeps the gap."),
    Exercise("half", "D. The half-precision laptop",
             "A float16 run on a laptop, mask and position ids built as generate() builds them, new tokens fed one at "
             "a time through the cache. The gap is hundreds of times what float32 shows. Bug or rounding?", "float16",
             LESSON_PROMPT, 3, "step", 0, "auto", "full",
             "Nothing wrong: float16's ε is 2^-10, so its rounding gaps are ~8000× float32's (ε 2^-23) - the same "
             "reduction-order differences, in a coarser format. float64 closes the gap."),
)
BY_KEY = {e.key: e for e in EXERCISES}
ANSWERS = ("precision", "logic")


@dataclass
class ExerciseRun:
    exercise: Exercise
    result: object  # the SplitResult (its settings are hidden from the student until the answer)

    @property
    def gap(self) -> float:
        return self.result.main.max_relative

    @property
    def float64_gap(self) -> float | None:
        f64 = self.result.float64
        return None if f64 is None else f64.max_relative

    @property
    def verdict(self) -> str:
        return self.result.verdict

    def check(self, answer: str) -> tuple[bool, str]:
        """(right?, one paragraph: the verdict's evidence and what was hidden)."""
        if answer not in ANSWERS:
            raise KvvizError(f"answer precision or logic, not {answer!r}")
        right = answer == self.verdict
        f64 = self.float64_gap
        evidence = (f"In {self.exercise.dtype} the largest relative gap is {self.gap:.3g}; rerun in float64 it is "
                    + ("0" if not f64 else f"{f64:.3g}") + f": kvviz's verdict is {self.verdict}.")
        return right, (("Right. " if right else f"Not this one: it is {self.verdict}. ") + evidence + " "
                       + self.exercise.hidden)


def run_exercise(key: str, models: Models, prompt: str | None = None) -> ExerciseRun:
    """Run the exercise `key` on the lesson's models (its dtype, and float64 for the evidence); `prompt` replaces
    its prompt (a tiny model's tokenizer makes other gaps)."""
    ex = BY_KEY.get(key)
    if ex is None:
        raise KvvizError(f"unknown exercise {key!r}; choose one of {', '.join(BY_KEY)}")
    if prompt is not None:
        ex = replace(ex, prompt=prompt)
    lm = models(ex.dtype)
    n = len(encode(lm, ex.prompt))
    return ExerciseRun(ex, views.run(split.VIEW, lm, ex.config(n), RunContext(prove=False, reference=models("float64"))))
