"""Peak RAM of converting a GGUF: streamed (tensor by tensor, kvviz's conversion) vs whole model (transformers').

    /usr/bin/time -f %M python bench/gguf_convert_bench.py streamed [file.gguf]
    /usr/bin/time -f %M python bench/gguf_convert_bench.py whole [file.gguf]
    python bench/gguf_convert_bench.py read-once [file.gguf or ""] [repeats]

read-once: kvviz's whole first-use conversion (kvviz.models.loading.convert_gguf, into a fresh cache each time) with
the file parsed once (kvviz.models.compat.gguf_read_once) against the same conversion parsing it at every reader
transformers and kvviz open (the way before), alternating, in one process.

Each run converts into a fresh temporary folder (kvviz's cache is not touched) and prints the seconds it took and
the folder's size; /usr/bin/time prints the peak RSS in KB on the last line. No file given: the default model.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvviz.models.loading import _convert_whole, _read_gguf_header, _saved_config, default_gguf_path  # noqa: E402
from kvviz.models.gguf_stream import stream_gguf  # noqa: E402


def read_once(path: Path, repeats: int) -> None:
    import contextlib
    import os

    from kvviz.models import compat, loading

    once = compat.gguf_read_once
    times: dict[str, list[float]] = {"each reader parses": [], "parsed once": []}
    for i in range(2 * repeats):
        way = ("each reader parses", "parsed once")[i % 2]
        compat.gguf_read_once = once if way == "parsed once" else contextlib.nullcontext
        with tempfile.TemporaryDirectory() as cache:
            os.environ["KVVIZ_CACHE"] = cache
            t0 = time.perf_counter()
            loading.convert_gguf(path)
            times[way].append(time.perf_counter() - t0)
    compat.gguf_read_once = once
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(json.dumps({"mode": "read-once", "file": path.name, "seconds": {k: [round(t, 1) for t in v]
                      for k, v in times.items()}, "ratio": round(med["parsed once"] / med["each reader parses"], 2)}))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "streamed"
    path = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else default_gguf_path()
    if mode == "read-once":
        return read_once(path, int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    if mode not in ("streamed", "whole"):
        raise SystemExit("mode: streamed | whole")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        config, tok = _read_gguf_header(path)
        if mode == "streamed":
            info = stream_gguf(path, Path(tmp), config, lambda f, m: None)
            _saved_config(config).save_pretrained(tmp)
        else:
            info = {}
            _convert_whole(path, Path(tmp), lambda f, m: None).save_pretrained(tmp)
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
        print(json.dumps({"mode": mode, "file": path.name, "seconds": round(seconds, 1), "folder_bytes": size, **info}))


if __name__ == "__main__":
    main()
