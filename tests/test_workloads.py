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


def _cli_plan(capsys, argv) -> list[str]:
    assert main([*argv, "--model", "tiny:llama", "--plan"]) == 0
    return capsys.readouterr().out.splitlines()


def _plan(view, cfg) -> list[str]:
    return plan_workload("tiny:llama", "float32", "cpu", view, cfg.workload()).lines()


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
        total("matrix", MatrixConfig(prompt=PROMPT))
    assert total("serving_sweep", SweepConfig(lengths=(16, 2048), concurrency=(1, 8), engine="transformers")) > \
        total("serving_sweep", SweepConfig(lengths=(16, 64), concurrency=(1, 8), engine="transformers"))
    assert SweepConfig(concurrency=(1, 8), engine="transformers").workload().batch == 8
    assert SweepConfig(concurrency=(1, 8), engine="vllm").workload().batch == 1  # vLLM holds its batch itself
    w = ServeConfig(prompts=["a", "bb"], shared_prefix="P: ", engine="vllm").workload()
    assert w == Workload(texts=("P: a", "P: bb"), new_tokens=16, batch=4, conditions=w.conditions, page_size=0)
