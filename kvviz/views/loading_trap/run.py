"""The loading trap: `from_pretrained(dtype=bfloat16)` and "load in float32, then `.to(bfloat16)`" are two
different models.

`.to(dtype)` casts every floating buffer, non-persistent ones included - the rotary `inv_freq` among them - while
`from_pretrained(dtype=...)` keeps such buffers in float32. The rotary angles then differ by up to a bfloat16 ulp of
the frequency times the position, and greedy paths part after a while: not the cache, not reduction order, but a
different model. This scenario builds both (the cast one as a private copy: the shared model is never touched),
lists the buffers whose dtype or values differ, and decodes greedily without cache with both.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from ...core.dtypes import dtype_name, parse_dtype
from ...core.errors import KvvizError
from ...core.execution import Executor, Settings, StepPolicy
from ...core.metrics import first_divergence
from ...core.inputs import Workload, build_inputs
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, RunContext
from ...core.estimate import Timed


@dataclass
class BufferDiff:
    name: str
    loaded_dtype: str
    cast_dtype: str
    max_abs: float


@dataclass(frozen=True)
class LoadingTrapSettings(Settings):
    model: str = ""
    dtype: str = ""  # the 16-bit dtype both loadings end in
    device: str = ""
    prompt: str = ""
    max_new_tokens: int = 0


@dataclass
class LoadingTrapResult(Timed):
    settings: LoadingTrapSettings
    buffers: list[BufferDiff]
    loaded_tokens: list[int]
    cast_tokens: list[int]
    loaded_text: str
    cast_text: str
    first_divergence: int | None
    max_abs_logit: list[float]
    verdict: str
    explanation: str

    def to_dict(self) -> dict:
        return asdict(self)


def _cast_copy(lm32: LoadedModel, dt: torch.dtype) -> LoadedModel:
    """What people do: a float32 model `.to(dtype)` - on a private deep copy, never the shared model."""
    model = copy.deepcopy(lm32.model).to(dt)
    return LoadedModel(spec=lm32.spec, model=model, tokenizer=lm32.tokenizer, dtype=dt, device=lm32.device,
                       attn_requested=lm32.attn_requested, attn_implementation=lm32.attn_implementation,
                       description=lm32.description + f", then .to({dtype_name(dt)})", source=lm32.source)


def _buffers(a, b) -> list[BufferDiff]:
    out = []
    bufs_b = dict(b.named_buffers())
    for name, x in a.named_buffers():
        y = bufs_b.get(name)
        if y is None or not x.is_floating_point():
            continue
        gap = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        if x.dtype != y.dtype or gap > 0:
            out.append(BufferDiff(name, dtype_name(x.dtype), dtype_name(y.dtype), gap))
    return out


def _greedy(lm: LoadedModel, prompt: str, n: int) -> tuple[list[int], torch.Tensor]:
    inp = build_inputs(lm, prompt, 0, extra_tokens=n)
    ex = Executor(lm)
    with ex.session():
        d = ex.decode(inp.ids, inp.mask, n, policy=StepPolicy.NO_CACHE, hidden=False)
    return d.tokens, torch.stack([lg.double() for lg in d.logits])


@dataclass(frozen=True)
class LoadingTrapConfig:
    """from_pretrained(dtype) against float32 + .to(dtype), greedy for max_new_tokens."""
    prompt: str = "This is a "
    max_new_tokens: int = 24
    dtype: str = "bfloat16"  # a 16-bit dtype

    def validate(self) -> "LoadingTrapConfig":
        if parse_dtype(self.dtype) in (torch.float32, torch.float64):
            raise KvvizError("the loading trap is about 16-bit dtypes: choose bfloat16 or float16")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or not 1 <= self.max_new_tokens <= 256:
            raise KvvizError(f"new tokens must be between 1 and 256, not {self.max_new_tokens}")
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the prompt and the new tokens (its twins: the memory profile's)."""
        # its time estimate: the model loaded in the dtype, and in float32 copied and cast to it in memory; both
        # decoded greedily without a cache (the whole sequence each step, the prompt's forward the first step) in that
        # dtype: no forward besides those steps
        return Workload(texts=(self.prompt,), new_tokens=int(self.max_new_tokens), forwards=0.0, full_paths=2,
                        run_dtypes=(str(self.dtype),), copies=(str(self.dtype), "float32"), casts=(str(self.dtype),))


def run_loading_trap(lm: LoadedModel, prompt: str = "This is a ", max_new_tokens: int = 24,
                     dtype: str = "bfloat16") -> LoadingTrapResult:
    """`lm` gives the model (any dtype: its twins are used). Compares from_pretrained(dtype) with float32 + .to()."""
    LoadingTrapConfig(prompt, max_new_tokens, dtype).validate()
    dt = parse_dtype(dtype)
    loaded = lm.twin(dt)
    cast = _cast_copy(lm.twin("float32"), dt)
    buffers = _buffers(loaded.model, cast.model)
    a_toks, a_logits = _greedy(loaded, prompt, max_new_tokens)
    b_toks, b_logits = _greedy(cast, prompt, max_new_tokens)
    div = first_divergence(a_toks, b_toks)
    gaps = (a_logits - b_logits).abs().amax(-1).cpu().tolist()
    tok = lm.tokenizer
    if not buffers:
        verdict = "same model"
        text = (f"This model has no floating buffers that .to({dtype_name(dt)}) would cast differently: both ways of "
                f"loading give the same model.")
    else:
        names = ", ".join(f"{b.name} ({b.loaded_dtype} vs {b.cast_dtype})" for b in buffers[:3])
        parted = (f"their greedy paths part at step {div}" if div is not None else
                  f"their greedy paths agree for {max_new_tokens} tokens, but the logits already differ by up to "
                  f"{max(gaps):.3g}")
        verdict = "different models"
        text = (f"Loading with dtype={dtype_name(dt)} and loading in float32 then calling .to({dtype_name(dt)}) give "
                f"two different models: .to() also casts non-persistent buffers - {names}. The rotary angles then "
                f"differ, {parted}. Not the cache and not reduction order: load with from_pretrained(dtype=...) to "
                f"compare like with like.")
    return LoadingTrapResult(settings=LoadingTrapSettings(model=lm.name, dtype=dtype_name(dt), device=str(lm.device),
                                                          prompt=prompt, max_new_tokens=max_new_tokens),
                             buffers=buffers, loaded_tokens=a_toks, cast_tokens=b_toks,
                             loaded_text=tok.decode(a_toks), cast_text=tok.decode(b_toks), first_divergence=div,
                             max_abs_logit=gaps, verdict=verdict, explanation=text)


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'invariant': 'it compares two loadings of the model, each decoded plainly', 'prove': 'it runs no proof rerun'}


def run(lm: LoadedModel, config: LoadingTrapConfig, ctx: RunContext = DEFAULT_CONTEXT) -> LoadingTrapResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running(REFUSES):  # its runs are its own: from_pretrained(dtype) against float32 + .to(dtype)
        return run_loading_trap(lm, config.prompt, config.max_new_tokens, config.dtype)
