"""Every page's default controls in one place: the pages draw their controls with these values and
bench/pages_bench.py times the library calls the pages make with them (the budget: each default run <= 30 s on a
quiet 2-core CPU with the default model). Defaults that teach: few prompts, tokens and cells; "more" is one
control away on each page."""

CAPITALS = "The capital of France is Paris, and the capital of Italy is"

DEFAULTS = {
    "split": {"prompt": CAPITALS},
    "greedy": {"prompt": "This is a ", "n": 12},
    "dtypes": {"prompt": CAPITALS, "dtypes": ("float32", "float16", "bfloat16")},
    "padding": {"prompt": CAPITALS, "left_pad": 4, "prove": False},
    "reuse": {"prefix": "You are a helpful assistant. Answer in one short sentence.\n",
              "continuations": ["Q: What is the capital of France?\nA:", "Q: What colour is the sky?\nA:"],
              "n": 8, "prove": False},
    "trap": {"prompt": "This is a ", "n": 12},
    "matrix": {"prompt": CAPITALS, "n": 8, "repeats": 2, "attn": ("eager", "sdpa"), "cache": ("dynamic", "static")},
    "kv": {"prompt": "The capital of France is", "tokens": 1024},
    "serving": {"category": "math_and_facts", "limit": 5, "runs": 3, "n": 8, "batch": 4},
    "quant": {"prompt": "The museum guard knew every painting in the building, but his favourite was",
              "kv": "quanto:int4", "n": 24},
}
