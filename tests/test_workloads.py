"""One typed workload a run: the CLI's --plan and a page plan a view from its config's own `workload()`
(kvviz.core.memory.Workload), never from loose keys or argparse attributes read one by one."""
import pytest

from kvviz.cli import main
from kvviz.core.memory import Workload, plan_workload
from kvviz.views.greedy.run import GreedyConfig
from kvviz.views.matrix.run import MatrixConfig
from kvviz.views.serving.run import ServeConfig
from kvviz.views.serving.sweep import SweepConfig

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def _planned(lines: list[str]) -> list[str]:
    """A plan's lines without the free memory measured when it was printed (it moves with the machine) and without
    the time estimate `--plan` prints beside it (tests/test_estimate.py checks that line)."""
    return [x for x in lines if not x.strip().startswith(("free", "fits", "does not fit", "time:"))]


def _cli_plan(capsys, argv) -> list[str]:
    assert main([*argv, "--model", "tiny:llama", "--plan"]) == 0
    return _planned(capsys.readouterr().out.splitlines())


def _plan(view, cfg) -> list[str]:
    return _planned(plan_workload("tiny:llama", "float32", "cpu", view, cfg.workload()).lines())


@pytest.mark.parametrize("argv, view, cfg", [
    (["greedy", "--prompt", PROMPT, "--max-new-tokens", "40", "--left-pad", "3"], "greedy",
     GreedyConfig(prompt=PROMPT, max_new_tokens=40, left_pad=3)),
    (["matrix", "--prompt", PROMPT, "--max-new-tokens", "30", "--attns", "eager,sdpa", "--batch-with", PROMPT * 3],
     "matrix", MatrixConfig(prompt=PROMPT, max_new_tokens=30, attentions=("eager", "sdpa"), batch_with=(PROMPT * 3,))),
    (["serving", "--prompt", PROMPT, "--max-new-tokens", "12", "--batch-size", "3", "--conditions", "alone,batch",
      "--engine", "transformers"], "serving",
     ServeConfig(prompts=[PROMPT], max_new_tokens=12, batch_size=3, conditions=("alone", "batch"))),
    (["serving", "--sweep", "--lengths", "16,300", "--concurrency", "1,6", "--max-new-tokens", "8",
      "--engine", "transformers"], "serving_sweep",
     SweepConfig(lengths=(16, 300), concurrency=(1, 6), max_new_tokens=8, engine="transformers")),
])
def test_the_cli_plans_a_view_from_its_configs_workload(capsys, argv, view, cfg):
    assert _cli_plan(capsys, argv) == _plan(view, cfg)


def test_a_configs_workload_carries_what_grows_the_plan():
    """Each field of the workload moves the plan the way the run grows: longer decodes, a longer batch neighbour,
    more requests in flight, a longer sweep row."""
    def total(view, cfg):
        return plan_workload("tiny:llama", "float32", "cpu", view, cfg.workload()).total

    assert total("greedy", GreedyConfig(prompt=PROMPT, max_new_tokens=200)) > \
        total("greedy", GreedyConfig(prompt=PROMPT, max_new_tokens=2))
    assert total("matrix", MatrixConfig(prompt=PROMPT, batch_with=(PROMPT * 40,))) > \
        total("matrix", MatrixConfig(prompt=PROMPT * 40))  # the batch-mate is a second row as long as the longest
    assert MatrixConfig(prompt=PROMPT, batch_with=("a", "b")).workload().batch == 3
    assert total("serving_sweep", SweepConfig(lengths=(16, 2048), concurrency=(1, 8), engine="transformers")) > \
        total("serving_sweep", SweepConfig(lengths=(16, 64), concurrency=(1, 8), engine="transformers"))
    assert SweepConfig(concurrency=(1, 8), engine="transformers").workload().batch == 8
    assert SweepConfig(concurrency=(1, 8), engine="vllm").workload().batch == 1  # vLLM holds its batch itself
    w = ServeConfig(prompts=["a", "bb"], shared_prefix="P: ", engine="vllm").workload()
    assert w == Workload(texts=("P: a", "P: bb"), new_tokens=16, batch=4, conditions=("alone", "batch", "warm"),
                         page_size=0)


def test_a_reload_is_planned_with_the_saved_caches_tokens(tmp_path, capsys):
    """`cache load` and the KV cache page plan the reloaded cache's tokens (read from the file's header) plus the
    continuation: a long saved cache is planned long, before anything loads."""
    import kvviz
    from kvviz.views.cache.run import ReloadConfig, save_cache, saved_token_count

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    short, long_ = tmp_path / "short.safetensors", tmp_path / "long.safetensors"
    save_cache(lm, "Hello world", short)
    save_cache(lm, PROMPT * 6, long_)
    n_long = len(lm.tokenizer(PROMPT * 6)["input_ids"])
    assert saved_token_count(long_) == n_long and saved_token_count(long_.read_bytes()) == n_long
    assert saved_token_count(tmp_path / "missing.safetensors") == 0
    w = ReloadConfig(continuation=" and then", source=long_).workload()
    assert w.tokens == n_long + len(" and then".encode()) + 1
    plan = _cli_plan(capsys, ["cache", "load", "--file", str(long_), "--continue", " and then"])
    assert plan == _planned(plan_workload("tiny:llama", "float32", "cpu", "kv_reload", w).lines())
    assert plan_workload("tiny:llama", "float32", "cpu", "kv_reload", w).total > plan_workload(
        "tiny:llama", "float32", "cpu", "kv_reload", ReloadConfig(continuation=" and then", source=short).workload()).total


BUILTIN_3 = tuple(__import__("kvviz.core.prompts", fromlist=["load_prompts"]).load_prompts("builtin", 3))
PAGE_CASES = [  # page, its run, its controls, the CLI command of the same settings (given the run's workload), what
    # the workload holds from those controls
    ("pages/split.py", "split", {"split_prompt": PROMPT, "split_pad": 2},
     lambda w: ["split", "--prompt", PROMPT, "--split", str(w.split), "--left-pad", "2"],
     {"texts": (PROMPT,), "left_pad": 2}),
    ("pages/split.py", "split", {"split_prompt": PROMPT, "attn": "eager"},  # the sidebar's attention: --attn
     lambda w: ["split", "--prompt", PROMPT, "--split", str(w.split), "--attn", "eager"],
     {"texts": (PROMPT,), "left_pad": 0}),
    ("pages/padding.py", "padding", {"padding_prompt": PROMPT, "padding_pad": 3, "padding_split": 4},
     lambda w: ["padding", "--prompt", PROMPT, "--left-pad", "3", "--split", "4", "--no-proof"],  # the proof off
     {"texts": (PROMPT,), "left_pad": 3, "split": 4, "prove": False}),
    ("pages/padding.py", "padding", {"padding_prompt": PROMPT, "padding_pad": 0, "padding_split": 0,  # 0: half
                                     "padding_prove": True},
     lambda w: ["padding", "--prompt", PROMPT, "--left-pad", "0"], {"left_pad": 0, "split": None, "prove": True}),
    ("pages/dtypes.py", "dtypes", {"dtypes_prompt": PROMPT, "dtypes_dtypes": ["bfloat16", "float16"],
                                   "dtypes_split": "half", "dtypes_mode": "step"},
     lambda w: ["dtypes", "--prompt", PROMPT, "--dtypes", "bfloat16,float16", "--split", "half", "--mode", "step"],
     {"texts": (PROMPT,), "dtypes": ("bfloat16", "float16"), "split": None}),
    ("pages/dtypes.py", "dtypes", {"dtypes_source": "built-in set", "dtypes_limit": 3, "dtypes_dtypes": ["float16"]},
     lambda w: ["dtypes", "--prompts", "builtin", "--limit", "3", "--dtypes", "float16"],
     {"texts": BUILTIN_3, "dtypes": ("float16",)}),
    ("pages/reuse.py", "reuse", {"reuse_prefix": PROMPT, "reuse_conts": " Rome\n and Madrid", "reuse_n": 6},
     lambda w: ["reuse", "--prefix", PROMPT, "--continuation", " Rome", "--continuation", " and Madrid",
                "--max-new-tokens", "6", "--no-proof"],
     {"texts": (PROMPT,), "continuations": (" Rome", " and Madrid"), "new_tokens": 6, "prove": False}),
    ("pages/reuse.py", "reuse", {"reuse_prefix": PROMPT, "reuse_conts": " Rome", "reuse_n": 4, "reuse_prove": True},
     lambda w: ["reuse", "--prefix", PROMPT, "--continuation", " Rome", "--max-new-tokens", "4"],
     {"continuations": (" Rome",), "prove": True}),
    ("pages/loading_trap.py", "trap", {"loading_trap_prompt": PROMPT, "loading_trap_n": 8,
                                       "loading_trap_dtype": "float16"},
     lambda w: ["loading-trap", "--prompt", PROMPT, "--max-new-tokens", "8", "--cast-dtype", "float16"],
     {"texts": (PROMPT,), "new_tokens": 8}),
    ("pages/quant.py", "quant", {"quant_prompt": PROMPT, "quant_n": 8, "quant_kv": "quanto:int4",
                                 "quant_weights": "int8"},
     lambda w: ["quant", "--prompt", PROMPT, "--max-new-tokens", "8", "--weights", "int8", "--kv", "quanto:int4"],
     {"texts": (PROMPT,), "new_tokens": 8, "weights": "int8"}),
    ("pages/greedy.py", "greedy", {"greedy_prompt": PROMPT, "greedy_n": 12},
     lambda w: ["greedy", "--prompt", PROMPT, "--max-new-tokens", "12", "--paths", ",".join(w.paths)],
     {"texts": (PROMPT,), "new_tokens": 12}),
    ("pages/check.py", "check", {"check_weights": "int8"}, lambda w: ["check", "--weights", "int8"],
     {"texts": (), "weights": "int8"}),
    ("pages/cache.py", "kv_save", {"cache_prompt": PROMPT},
     lambda w: ["cache", "save", "--prompt", PROMPT, "--out", "never-written.safetensors"], {"texts": (PROMPT,)}),
    ("pages/cache.py", "kv_size", {"cache_tokens": 300, "cache_batch": 2},
     lambda w: ["cache", "size", "--tokens", "300", "--batch", "2"], {"texts": (), "tokens": 300, "batch": 2}),
]


@pytest.mark.app
@pytest.mark.parametrize("case", PAGE_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(PAGE_CASES)])
def test_a_page_hands_its_run_the_workload_of_its_controls_and_plans_as_the_cli(monkeypatch, capsys, case):
    """The page itself (AppTest, its controls set): the workload it hands run_cached is what its controls say, and
    the plan it shows (pages/memory_plan.plan_for: the sidebar's attention on top) is the plan of the same settings
    on the command line."""
    from argparse import Namespace

    import pages.runner
    from apptest import start
    from pages.memory_plan import plan_for

    path, run_name, state, argv_of, expect = case
    seen = {}

    def recording(name, key_parts, compute, workload=None, lm=None):
        seen[name] = workload
        raise RuntimeError("recorded")  # the page shows it in one line and stops: nothing runs

    monkeypatch.setattr(pages.runner, "run_cached", recording)
    start(path, model="tiny:llama", **state)
    w = seen[run_name]
    assert isinstance(w, Workload)
    assert {k: getattr(w, k) for k in expect} == expect
    view = __import__("kvviz").views.for_run(run_name).name
    choice = Namespace(spec="tiny:llama", dtype="float32", device="cpu", attn=state.get("attn", "auto"))
    assert _cli_plan(capsys, argv_of(w)) == _planned(plan_for(choice, view, w).lines())


def test_the_cli_plans_a_configs_workload_with_its_attention(capsys):
    """A command that plans its config's workload (which names no attention) plans it with --attn, as a page plans
    it with the sidebar's: eager's materialised scores are in the plan."""
    from dataclasses import replace

    from kvviz.core.inputs import SplitConfig

    argv = ["split", "--prompt", PROMPT * 8, "--split", "5"]
    w = SplitConfig(prompt=PROMPT * 8, split=5).workload()
    eager = _cli_plan(capsys, [*argv, "--attn", "eager"])
    eager_plan = plan_workload("tiny:llama", "float32", "cpu", "split", replace(w, attention="eager"))
    assert eager == _planned(eager_plan.lines())
    assert _cli_plan(capsys, argv) == _plan("split", SplitConfig(prompt=PROMPT * 8, split=5))
    sdpa_plan = plan_workload("tiny:llama", "float32", "cpu", "split", w)
    # (the lines can round alike: the proof's kernel probes are most of a tiny model's activations)
    assert sdpa_plan.if_unproved["activations"] < eager_plan.if_unproved["activations"]
    assert sdpa_plan.total < eager_plan.total


def test_a_run_told_not_to_prove_has_no_proof_phase_in_its_plan(capsys):
    """--no-proof (and a page's proof toggled off: `Workload.prove`) plans no proof phase: the plan was the proved
    run's (its kernel probes) even where no proof would run. In invariant mode throughout the probes stay."""
    from dataclasses import replace

    from kvviz.core.inputs import SplitConfig

    w = SplitConfig(prompt=PROMPT * 8, split=5).workload()
    proved, unproved = (plan_workload("tiny:llama", "float32", "cpu", "split", replace(w, prove=p)) for p in (1, 0))
    assert proved.if_unproved is not None and unproved.if_unproved is None
    assert unproved.activations == proved.if_unproved["activations"] < proved.activations
    assert unproved.total < proved.total
    argv = ["split", "--prompt", PROMPT * 8, "--split", "5"]
    assert _cli_plan(capsys, [*argv, "--no-proof"]) == _planned(unproved.lines())
    assert _cli_plan(capsys, argv) == _planned(proved.lines())
    inv = plan_workload("tiny:llama", "float32", "cpu", "split", replace(w, prove=False), invariant=True)
    assert inv.activations >= proved.activations


def test_a_config_without_workload_is_planned_from_its_fields_as_its_subcommand_reads_them():
    """The generic page plans a view config without workload() as the subcommand generated from it reads its
    options: a list field (one comma-separated option there) keeps its values (a tuple read as an option lost them)."""
    from dataclasses import dataclass

    from kvviz.io.clirun import config_workload

    @dataclass(frozen=True)
    class Cfg:
        prompt: str = PROMPT
        max_new_tokens: int = 7
        left_pad: int = 2
        dtypes: tuple[str, ...] = ("bfloat16", "float16")
        paths: tuple[str, ...] = ("cache", "no_cache")

    w = config_workload(Cfg())
    assert (w.texts, w.new_tokens, w.left_pad) == ((PROMPT,), 7, 2)
    assert w.dtypes == ("bfloat16", "float16") and w.paths == ("cache", "no_cache")
    assert config_workload(GreedyConfig(prompt=PROMPT, max_new_tokens=3)) == \
        GreedyConfig(prompt=PROMPT, max_new_tokens=3).workload()


def test_a_run_in_invariant_mode_plans_the_kernel_probes_and_keeps_them(capsys):
    """The first invariant-mode forward probes the kernels of each weight's shape (memory.invariant_probe_bytes): a
    view with a proof plans it as a phase of its own that `settle` drops when no proof ran (--no-proof); a run in
    invariant mode throughout (the sidebar's toggle, --invariant) keeps it, and a view without a proof gets it too.
    The CLI's --plan and the page's plan_for count it alike."""
    from types import SimpleNamespace

    from kvviz.core import memory
    from kvviz.core.inputs import SplitConfig
    from kvviz.views.loading_trap.run import LoadingTrapConfig
    from pages.memory_plan import plan_for

    w = SplitConfig(prompt=PROMPT, split=3).workload()
    shape = memory.model_shape("tiny:llama")
    probe = memory.invariant_probe_bytes(shape, 4)
    plain = plan_workload("tiny:llama", "float32", "cpu", "split", w)
    inv = plan_workload("tiny:llama", "float32", "cpu", "split", w, invariant=True)
    assert plain.if_unproved is not None and inv.if_unproved is None
    run_only = memory.activation_bytes(shape, "float32", plain.tokens, 1, "split", False, plain.tokens - 3)
    # Split point probes in its invariant run's first forward (the prefix, one row of logits), not beside the
    # run's full forward; after the float64 rerun, whose float64 cache is freed by then (the twin stays)
    probing = probe + memory.working_bytes(shape, 4, plain.tokens) + shape.vocab * 4
    f64_cache = plain.cache - memory.cache_bytes(shape, "float32", plain.tokens, 1, False)
    assert plain.activations == max(plain.if_unproved["activations"], run_only, probing - f64_cache)
    with_ref = memory.activation_bytes(shape, "float32", plain.tokens, 1, "split", True, plain.tokens - 3)
    # in invariant mode throughout the probes come in the run's own first forward, before any float64 rerun
    assert inv.activations == max(with_ref, run_only, probing) >= plain.activations
    # identical in invariant mode (no float64 rerun, no proof rerun): the probes stay in the settled plan
    assert inv.if_identical["activations"] >= probing
    without = plain.if_unproved["activations"]
    assert plain.settle(SimpleNamespace(float64=object(), proof_s=None)).activations == without < plain.total
    before = inv.activations
    assert inv.settle(SimpleNamespace(float64=object(), proof_s=None, settings=SimpleNamespace(
        execution=SimpleNamespace(invariant=True)))).activations == before
    # a view without a proof of its own: nothing planned for probes unless the run is in invariant mode
    trap = LoadingTrapConfig(prompt=PROMPT).workload()
    normal = plan_workload("tiny:llama", "float32", "cpu", "loading_trap", trap)
    trapped = plan_workload("tiny:llama", "float32", "cpu", "loading_trap", trap, invariant=True)
    assert normal.if_unproved is None and trapped.activations == normal.activations + probe
    # the CLI and the page plan it the same way
    cli = _cli_plan(capsys, ["split", "--prompt", PROMPT, "--split", "3", "--invariant"])
    assert cli == _planned(inv.lines())
    choice = SimpleNamespace(spec="tiny:llama", dtype="float32", device="cpu", attn="sdpa", invariant=True)
    assert _planned(plan_for(choice, "split", w).lines()) == cli
