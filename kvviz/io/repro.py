"""Repro scripts: a standalone Python file (torch and transformers only, no kvviz) that rebuilds a scenario and
prints its key figures; its last line `max |Δ logits| = <repr>` equals the result's figure bit for bit on the same
machine (same model folder, dtype, device, attention implementation, inputs, masks and position ids), whatever
the threads or CPU variables of whoever runs it: it sets the numerics the result was computed with (torch's threads,
ATen's CPU capability, MKL/oneDNN/OpenMP variables before `import torch`, deterministic algorithms, float32 matmul
precision; kvviz.core.numerics) and prints them first.

Each view's script (kvviz/views/<view>/repro.py: `check`, `script`, `key_figure`) makes exactly the model calls kvviz made (same shapes, same masks and position ids, same
cache objects in the same order), so the numbers agree to the last bit, not just closely:
  split    the prefix cached, the rest in one chunk or token by token, vs one full forward;
  greedy   the no-cache loop vs the cached loop (the figure: the largest |Δ logit| while both saw the same tokens);
  dtypes   the split comparison per dtype (float64 aside) and prompt (the figure: the largest over all);
  padding  the prompt alone, left-padded and in a batch, every cache setting (the figure: the largest over cells);
  reuse    fresh / deep-copied / reused prefix cache per continuation (the figure: the largest against fresh while
           the tokens agree);
  loading_trap  from_pretrained(dtype) vs float32 + .to(dtype), greedy without cache (the figure: the largest over
           the steps);
  quant    the unquantized run vs the quantized one teacher forced on its tokens (the figure: the largest over the
           steps). This script also needs the quantization package the result used (optimum-quanto or hqq; fp8
           needs none);
  matrix   every cell that ran without torch.compile (attention × cache kind × precision flags) against the eager
           no-cache loop (the figure: the largest cell's max |Δ logit|); compiled cells are left out (compiled
           kernels are not a bit-for-bit contract) and the script says which;
  serving  the same continuous-batching calls (alone / batch / warm, the same draws) made plainly with
           transformers' engine, and the no-cache reference (the figure: prompts with 1 distinct completion);
  check    the cache-safety card's split-based checks in float64 (cached vs full in one chunk and token by token,
           left padding, past the sliding window; the figure: the largest |Δ logit| over them).
"""
from __future__ import annotations

import ast
import importlib
import inspect

from .. import views
from ..core import capture, float64
from ..core.errors import KvvizError
from ..models.loading import LoadedModel


def repro_views() -> tuple[str, ...]:
    """The views with a standalone repro script (the registry's `repro` entries)."""
    return views.names(repro=True)


HEADER = '''# kvviz repro: {title}
# Standalone: needs only torch and transformers. Run: python {name}
{prelude}
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = {folder!r}  # the model folder kvviz loaded ({model})
DEVICE = {device!r}
ATTN = {attn!r}
CACHE_KW = {cache_kw!r}  # the keyword this transformers takes a cache by (`cache` from 5.24, `past_key_values` before)
{float64_mode}
tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


def load(dtype):
    kw = {{}} if ATTN == "auto" else {{"attn_implementation": ATTN}}
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype, local_files_only=True, **kw).to(DEVICE).eval()
    if dtype == torch.float64:
        keep_float64(m)
    return m


def load_attn(dtype, attention):
    """The model with a given attention implementation (the backends matrix loads one per implementation)."""
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype, local_files_only=True,
                                             attn_implementation=attention).to(DEVICE).eval()
    if dtype == torch.float64:
        keep_float64(m)
    return m


def forward(model, ids, mask=None, positions=None, past=None, use_cache=True, hidden=True, keep=None):
    """One model call, as kvviz makes it: mask / positions / past left out when None; keep: logits_to_keep."""
    kw = dict(input_ids=ids, use_cache=use_cache, output_hidden_states=hidden, return_dict=True)
    if keep is not None:
        kw["logits_to_keep"] = keep
    if mask is not None:
        kw["attention_mask"] = mask
    if positions is not None:
        kw["position_ids"] = positions
    if past is not None:
        kw[CACHE_KW] = past
    return model(**kw)

{compat}


def positions_from(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def caller(model):
    """One model call as the loops below take it."""
    def call(ids, mask, positions, past, use_cache=True, hidden=True):
        return forward(model, ids, mask, positions, past, use_cache=use_cache, hidden=hidden)
    return call

{loops}

def split_gap(model, ids, split, left_pad=0, mode="chunk", positions_mode="auto", mask_mode="full"):
    """The split comparison: the prefix [0, split) cached, the rest fed through the cache, vs one full forward.
    Returns the per-token max |Δ logit| (float64) and whether the next token agrees."""
    pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    input_ids = torch.tensor([[pad_id] * left_pad + ids], device=DEVICE)
    mask = torch.tensor([[0] * left_pad + [1] * len(ids)], device=DEVICE)
    positions = positions_from(mask)
    a0, total = left_pad + split, left_pad + len(ids)

    def rest_mask(start, end):
        return mask[:, :end] if mask_mode == "full" else mask[:, start:end]

    def rest_positions(start, end):
        return positions[:, start:end] if positions_mode == "auto" else None

    past = output_cache(forward(model, input_ids[:, :a0], mask[:, :a0], positions[:, :a0]))
    # in float64 (the reference) kvviz computes only the compared positions' logits (logits_to_keep)
    import inspect

    keep = total - a0 if model.dtype == torch.float64 and \
        "logits_to_keep" in inspect.signature(model.forward).parameters else None
    ref = forward(model, input_ids, mask, positions, keep=keep).logits[0, -(total - a0):]
    rows = [out.logits[0] for _, _, out in feed(caller(model), input_ids[:, a0:], past, mode != "chunk",
                                                 lambda s, e: rest_mask(a0 + s, a0 + e),
                                                 lambda s, e: rest_positions(a0 + s, a0 + e))]
    got = torch.cat(rows)
    return (got.double() - ref.double()).abs().amax(-1), (got.argmax(-1) == ref.argmax(-1))

'''


def check_reproducible(result) -> str:
    """The result's view name when a repro script can rebuild it; KvvizError with the one-line reason otherwise."""
    view = views.of(result)
    if not view.repro:
        raise KvvizError(f"repro scripts are written for {', '.join(repro_views())}; this {view.name} result has its "
                         "JSON and HTML exports")
    view.repro_module().check(result)
    return view.name


def repro_script(result, lm: LoadedModel, name: str = "kvviz_repro.py") -> str:
    """A standalone script for a result of one of repro_views() computed with `lm` (any dtype of the same model: the
    script loads the dtypes the result used); KvvizError with one line for what no script can rebuild."""
    return views.get(check_reproducible(result)).repro_module().script(result, lm, name)


def key_figure(result) -> float:
    """The figure a repro script's last line reproduces (see the module's docstring)."""
    return views.get(check_reproducible(result)).repro_module().key_figure(result)


def require_plain(result) -> None:
    """A script rebuilds the plain run: refuse a result computed with invariant mode, other cache kinds or flags."""
    s = result.settings
    if not s.execution.is_default:
        raise KvvizError(f"a repro script rebuilds the plain run; this one used {s.execution.label()} "
                         "(invariant mode, cache kinds and flags live in kvviz)")


def plain_head(result, lm: LoadedModel, name: str, float64: bool = True) -> dict:
    """The header fields of a view whose settings are typed (model, device, dtype): float64 mode where it ran in
    float64 (float64=False: the script loads float64 only as its reference, e.g. the dtype sweep)."""
    s = result.settings
    return dict(name=name, folder=lm.source, model=s.model, device=s.device, attn=lm.attn_requested,
                float64_mode=float64_mode() if float64 and s.dtype == "float64" else NO_FLOAT64)


def header(title: str, **head) -> str:
    """The script's first lines. User text (a model path such as C:\\Users\\..., a prompt) goes only into comments
    with its line breaks removed, or into string literals through repr(): no spec can break the script's syntax."""
    one_line = {k: (" ".join(str(v).splitlines()) if k in ("title", "model", "name") else v) for k, v in head.items()}
    from ..models import compat

    from ..core.numerics import numerics, script_prelude

    return HEADER.format(title=" ".join(title.splitlines()), loops=loops_source(), compat=compat.script_source(),
                         cache_kw=compat.cache_argument_name(), prelude=script_prelude(numerics()), **one_line)


def loops_source() -> str:
    """kvviz's decode loop and feed (kvviz/core/loops.py), copied into the script: the script runs the library's loop."""
    return ("\n# kvviz's loops: a copy of loops.py in the kvviz package (Executor.decode and Executor.feed run them)"
            + module_body("core.loops"))


def source_body(module) -> tuple[str, list[str]]:
    """A module's source, as parsed (ast), without its docstring, `from __future__` and its relative imports: the
    code a script can carry. Returns (source, the relative imports left out, e.g. ".capture")."""
    src = inspect.getsource(module)
    lines, cut, relative = src.splitlines(keepends=True), set(), []
    for i, node in enumerate(ast.parse(src).body):
        doc = i == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
        future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        rel = isinstance(node, ast.ImportFrom) and node.level > 0
        if rel:
            relative.append("." * node.level + (node.module or ""))
        if doc or future or rel:
            cut.update(range(node.lineno - 1, node.end_lineno))
    return "".join(line for k, line in enumerate(lines) if k not in cut), relative


def module_body(name: str) -> str:
    """A torch-only kvviz module's source without its docstring and its imports (the script has them), to copy into
    a script: the script then runs the library's own code (kvviz.core.loops, kvviz.core.flags). Its kvviz imports are
    dropped too: the script defines its own copies of what they bring (output_cache)."""
    src, _ = source_body(importlib.import_module(f"kvviz.{name}"))
    return "\n" + "\n".join(line for line in src.splitlines() if line not in ("import torch", "import contextlib"))


NO_FLOAT64 = "\n\ndef keep_float64(model):  # not needed here\n    pass\n"


def float64_mode() -> str:
    """kvviz's own KeepFloat64 mode (kvviz/core/float64.py), copied into the script so it needs no kvviz."""
    # float64.py releases layers through kvviz's one capture module (core/capture.py, standard library only): the
    # script carries a copy of that module first, and float64's import of it goes
    own, rel = source_body(float64)
    cap, rel_cap = source_body(capture)
    if rel != [".capture"] or rel_cap:
        raise KvvizError("kvviz/core/float64.py imports another kvviz module: the repro script cannot copy it")
    return ("\n# kvviz's one capture module (hooks removed on exit), a copy of capture.py in the kvviz package\n"
            + cap + "\n# kvviz keeps float64 models in float64 (transformers' float32 'upcasts' would round): "
            "its mode, a copy of float64.py in the kvviz package\n" + own)
