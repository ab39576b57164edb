"""python -m kvviz: JSON output, readable summary, one-line errors with non-zero exit."""
import json
import subprocess
import sys

import pytest

from kvviz.cli import main

from conftest import PROMPT, ROOT


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_split_json_has_everything(capsys):
    code, out, err = run_cli(capsys, "split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "10",
                             "--dtype", "float32", "--left-pad", "3", "--position-ids", "omit", "--json", "--quiet")
    assert code == 0, err
    d = json.loads(out)
    assert d["settings"]["split"] == 10 and d["settings"]["left_pad"] == 3 and d["settings"]["dtype"] == "float32"
    assert d["verdict"] == "logic"
    n = len(d["tokens"]) - 10
    assert d["compared_positions"] == list(range(10, len(d["tokens"])))
    for metric in ("max_abs", "mean_abs", "relative", "cosine", "eps_units"):
        m = d["result"]["hidden"][metric]
        assert len(m) == len(d["layer_labels"]) == 5 and all(len(row) == n for row in m)
    assert set(d["result"]["logits"]) >= {"max_abs", "kl", "argmax_agree", "top5_overlap"}
    assert len(d["result"]["kv"]) == 4
    assert d["result"]["describe"]["absolute Δ"]["max"] > 0
    assert d["float64_evidence"]["dtype"] == "float64" and d["float64_evidence"]["max_relative"] > 1e-3


def test_split_summary_is_readable(capsys):
    code, out, err = run_cli(capsys, "split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "5",
                             "--dtype", "bfloat16", "--mode", "step")
    assert code == 0
    assert "verdict: PRECISION" in out or "verdict: IDENTICAL" in out
    assert "layer 4 + final norm" in out
    assert "%]" in err  # progress went to stderr


@pytest.mark.parametrize("args, msg", [
    (["split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "0"], "outside the prompt"),
    (["split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "500"], "outside the prompt"),
    (["split", "--model", "tiny:gpt2", "--prompt", "  ", "--split", "1"], "empty"),
    (["split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "3", "--left-pad", "-1"], "left-pad"),
    (["split", "--model", "nowhere/../x", "--prompt", PROMPT, "--split", "3"], "not found"),
    (["split", "--model", "tiny:bert", "--prompt", PROMPT, "--split", "3"], "unknown tiny architecture"),
])
def test_bad_input_one_line_nonzero(capsys, args, msg):
    code, out, err = run_cli(capsys, *args, "--quiet")
    assert code != 0
    assert msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_argument_types_exit_2():
    # through the real entry point: argparse errors are one line too
    p = subprocess.run([sys.executable, "-m", "kvviz", "split", "--model", "tiny:gpt2", "--prompt", "x",
                        "--split", "abc"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("kvviz: error:") and len(p.stderr.strip().splitlines()) == 1
    p = subprocess.run([sys.executable, "-m", "kvviz", "split", "--prompt", "x", "--split", "1", "--dtype", "int4"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "invalid choice" in p.stderr
