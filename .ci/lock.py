"""`make lock`'s last step: a freeze of the environment the whole suite just passed in becomes requirements.lock,
and the top of kvviz's tested transformers range (kvviz/models/compat.py TESTED_MAX, pyproject.toml) moves to its
transformers. Usage: python .ci/lock.py FREEZE_FILE"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(freeze: str) -> int:
    lines = [ln.strip() for ln in Path(freeze).read_text().splitlines()
             if ln.strip() and not ln.startswith(("-e ", "#")) and " @ " not in ln and not ln.startswith("kvviz==")]
    pins = dict(ln.split("==", 1) for ln in lines if "==" in ln)
    if "transformers" not in pins or "torch" not in pins:
        print(f"{freeze}: no transformers/torch pin; nothing written", file=sys.stderr)
        return 2
    header = ("# The exact versions `make test` passed with (written by `make lock`; `make run` and `make test` "
              "install these).\n")
    (ROOT / "requirements.lock").write_text(header + "\n".join(sorted(lines, key=str.lower)) + "\n")
    top = pins["transformers"]
    compat = ROOT / "kvviz" / "models" / "compat.py"
    compat.write_text(re.sub(r'^TESTED_MAX = ".*"$', f'TESTED_MAX = "{top}"', compat.read_text(), flags=re.M))
    py = ROOT / "pyproject.toml"
    py.write_text(re.sub(r'"transformers>=([^,]+),<=[^"]+"', rf'"transformers>=\1,<={top}"', py.read_text()))
    print(f"requirements.lock: {len(lines)} packages, transformers {top}, torch {pins['torch']}; "
          f"tested range now up to {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
