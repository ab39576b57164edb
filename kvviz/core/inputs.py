"""Turning a prompt into model inputs: tokens, left padding, attention mask and position ids."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import KvvizError
from .text import display_tokens

MAX_PROMPT_CHARS = 100_000
POSITION_MODES = ("auto", "omit")
MASK_MODES = ("full", "new-only")
MODES = ("chunk", "step")  # how a split's rest goes through the cache: one chunk, or a token at a time


@dataclass
class PromptInputs:
    """One left-padded prompt: `ids`, `mask` and `positions` are [1, pad + n_tokens] on the model's device."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    pad: int
    token_ids: list[int]
    token_texts: list[str]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def total(self) -> int:
        return self.pad + self.n_tokens


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() derives them: count real tokens; pads get 1 (they are masked anyway)."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its EOS token, else 0."""
    return int(next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0))


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """One display string per token; multi-byte characters split over several tokens are shown whole."""
    return display_tokens(tokenizer, ids)


def validate_prompt(prompt) -> str:
    if prompt is None or not isinstance(prompt, str):
        raise KvvizError("the prompt must be text")
    if not prompt.strip():
        raise KvvizError("the prompt is empty; type some text to compare")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise KvvizError(f"the prompt has {len(prompt):,} characters; kvviz takes at most {MAX_PROMPT_CHARS:,}")
    return prompt


def encode(lm, prompt: str) -> list[int]:
    validate_prompt(prompt)
    ids = lm.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise KvvizError("the prompt gives no tokens")
    return [int(i) for i in ids]


def check_context(lm, ids: list[int], left_pad: int = 0, extra_tokens: int = 0) -> None:
    """Refuse in one line a prompt that, with its padding and the tokens to come, is longer than the model's
    context (the model would index past its position table)."""
    total = left_pad + len(ids) + extra_tokens
    limit = lm.max_positions
    if limit is not None and total > limit:
        raise KvvizError(f"the prompt is {len(ids)} tokens (+{left_pad} padding, +{extra_tokens} to generate) = "
                         f"{total}, longer than the model's context of {limit} tokens")


def left_pad_rows(lm, rows: list[list[int]], extra_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids left-padded to one width (the longest row + `extra_pad`): ids and attention mask."""
    width = max(len(r) for r in rows) + extra_pad
    pid = pad_token_id(lm.tokenizer)
    ids = torch.tensor([[pid] * (width - len(r)) + r for r in rows], dtype=torch.long, device=lm.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=lm.device)
    return ids, mask


def build_inputs(lm, prompt: str, left_pad: int = 0, extra_tokens: int = 0) -> PromptInputs:
    """Tokenize, left-pad with `left_pad` pad tokens, and check that pad + prompt (+ tokens to come) fits."""
    if not isinstance(left_pad, int) or left_pad < 0:
        raise KvvizError(f"left padding must be 0 or more, not {left_pad}")
    ids = encode(lm, prompt)
    check_context(lm, ids, left_pad, extra_tokens)
    full, mask = left_pad_rows(lm, [ids], left_pad)
    return PromptInputs(ids=full, mask=mask, positions=positions_from_mask(mask), pad=left_pad, token_ids=ids,
                        token_texts=token_texts(lm.tokenizer, ids))


def check_mode(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise KvvizError(f"unknown {what} '{value}'; choose one of {', '.join(allowed)}")
    return value


@dataclass
class Workload:
    """What a run holds, as the CLI's arguments and a page's run both describe it: kvviz.core.memory.plan_workload
    turns it into the plan, the same way for both."""
    texts: tuple[str, ...] = ()  # the prompt(s) and prefix: the longest counts
    continuations: tuple[str, ...] = ()  # texts appended to it (reuse): the longest counts
    new_tokens: int = 0
    left_pad: int = 0
    tokens: int | None = None  # a run that names its token count (the cache sizes)
    batch: int | None = None  # a run that names its batch (the cache sizes)
    dtypes: tuple[str, ...] = ()  # the dtypes view: the dtypes run side by side
    split: int | None = None  # the split point (views comparing only the positions after it)
    weights: str = "none"  # weight quantization ("none": the model as loaded)
    paths: tuple[str, ...] = ()  # the paths a decoding view runs (greedy; empty: its defaults)
    attention: str = "auto"  # the attention implementation the run asks for (its score workspace: score_bytes)
    # a study through a paged engine (kvviz.views.serving.memory.ServingMemory; its prompts are `texts`, each with
    # its prefix, and its requests in flight `batch`): the conditions it runs (empty: every one the profile names)
    # and the tokens a cache page holds (None: PAGE_SIZE; 0: no paged engine in this process - vLLM, llama.cpp, a
    # server)
    conditions: tuple[str, ...] = ()
    page_size: int | None = None
    prove: bool = True  # the run may prove a precision verdict in invariant mode (False: --no-proof, a proof toggled off)
    # what the run computes, for its time estimate (kvviz.core.estimate): full forwards over the input; decoding
    # paths that step through a cache (`decode_paths`) or rerun the whole sequence each step (`full_paths`, in float64:
    # `float64_paths`), each for the new tokens - or, with `steps_after_split`, for the input's tokens after the
    # split; `float64_rerun`: the run may be rerun in float64 for its verdict; `proves`: a precision verdict may be
    # proved by an invariant-mode rerun (as `prove` allows). Not compared: the memory plan's workload is the same
    # whoever describes it (the CLI reads it off its arguments)
    forwards: float = field(default=1.0, compare=False)
    # model calls over those forwards' tokens where there are more (a prefix, the rest through the cache and the full
    # forward: 3 calls, 2 forwards' tokens); each call pays the call's fixed cost (reading every weight once)
    calls: float | None = field(default=None, compare=False)
    decode_paths: int = field(default=0, compare=False)
    full_paths: int = field(default=0, compare=False)
    float64_paths: int = field(default=0, compare=False)
    steps_after_split: bool = field(default=False, compare=False)
    float64_rerun: bool = field(default=False, compare=False)
    proves: bool = field(default=False, compare=False)
    # more of what the run computes (the estimate prices each from this machine's calibration; none names a view):
    # `float64_certain`: the float64 rerun always runs (its numbers are every verdict's yardstick), not only when the
    # paths differ; `run_dtypes`: the dtypes the run's own work is done in, once each (empty: the model's own), each
    # at that dtype's measured pace; `copies`: the model loaded again - "float64" (the float64 twin), "bfloat16", or
    # "@eager" / "float64@eager" (another attention implementation) - each priced, where it is not loaded yet, at
    # the model's own measured load rate for its size in that dtype; `casts`: in-memory copies of the weights made
    # by the run (a deep copy `.to(dtype)`, a quantized copy), at the measured copy rate; `lens`: hidden states put
    # through the model's final norm and head (a logit lens), per hidden state of the model and compared position
    float64_certain: bool = field(default=False, compare=False)
    run_dtypes: tuple[str, ...] = field(default=(), compare=False)
    copies: tuple[str, ...] = field(default=(), compare=False)
    casts: tuple[str, ...] = field(default=(), compare=False)
    lens: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class SplitConfig:
    """A prompt split: its first `split` tokens go to the cache, the rest through it (split and bisect run it)."""
    prompt: str
    split: int
    mode: str = "chunk"
    left_pad: int = 0
    position_ids: str = "auto"
    attention_mask: str = "full"

    def validate(self) -> None:
        check_mode(self.mode, MODES, "mode")
        check_mode(self.position_ids, POSITION_MODES, "position-ids mode")
        check_mode(self.attention_mask, MASK_MODES, "attention-mask mode")
        if not isinstance(self.split, int) or isinstance(self.split, bool):
            raise KvvizError(f"the split must be a whole number, not {self.split!r}")
        if not isinstance(self.left_pad, int) or self.left_pad < 0:
            raise KvvizError(f"left padding must be 0 or more, not {self.left_pad}")

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the prompt, its left padding, the positions after the split."""
        # its time estimate: chunk feeds the full forward, the prefix and the rest in about two forwards' time; step
        # feeds the rest token by token through the cache; a gap is rerun in float64 and a precision verdict proved
        step = self.mode == "step"
        return Workload(texts=(self.prompt,), left_pad=int(self.left_pad), split=self.split,
                        forwards=1.5 if step else 2.0, calls=None if step else 3.0, decode_paths=int(step),
                        steps_after_split=step,
                        float64_rerun=True, proves=True, copies=("float64",))

def check_split(n_tokens: int, split: int) -> None:
    if n_tokens < 2:
        raise KvvizError("the prompt is a single token; a split needs at least 2 tokens")
    if not 1 <= split <= n_tokens - 1:
        raise KvvizError(f"split {split} is outside the prompt: choose 1 to {n_tokens - 1} "
                         f"(the prompt has {n_tokens} tokens; at least one must go to the cache and one after it)")


def split_point(n_tokens: int, split: int | str) -> int:
    """'last': all but the last token go to the cache; 'half'; or a number (clipped)."""
    if split == "last":
        return n_tokens - 1
    if split == "half":
        return max(1, n_tokens // 2)
    return min(int(split), n_tokens - 1)


def cached_mask(attention_mask: str, inp: PromptInputs, start: int, end: int) -> torch.Tensor:
    """`full`: past + new (what the model needs); `new-only`: just the new tokens (a mistake transformers accepts)."""
    if attention_mask == "full":
        return inp.mask[:, :end]
    return inp.mask[:, start:end]
