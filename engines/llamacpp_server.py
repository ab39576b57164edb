"""llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, the same arguments) with llama.cpp's
weight repacking off (llama_model_params.use_extra_bufts = false), for CPUs where the AMX-repacked matmul crashes
(docs/engines.md: on this machine's CPU, which reports AMX, the first Q4_1 decode segfaults in
ggml_backend_amx_mul_mat). llama-cpp-python has no option for it, so its default model params are wrapped, as
kvviz's llama.cpp worker does. Run it with the llama.cpp environment's python (engines/build.sh llamacpp):

    ~/.cache/kvviz-engines/llamacpp/bin/python engines/llamacpp_server.py --model X.gguf --host 127.0.0.1 --port 8080
"""
import llama_cpp
import llama_cpp.llama as module
from llama_cpp.server.__main__ import main

_default = llama_cpp.llama_model_default_params


def _params():
    p = _default()
    p.use_extra_bufts = False
    return p


module.llama_cpp.llama_model_default_params = _params

if __name__ == "__main__":
    main()
