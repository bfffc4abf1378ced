"""Print the requirements of the installed ``sglang`` wheel that a CPU-only machine can use.

.ci/install_engines installs sglang with --no-deps, then these: the wheel's own requirements
minus the CUDA-only kernels and libraries (none of which imports or runs without a GPU), the
audio/video/vision extras a text model never loads, and what was pinned before it (torch,
torchvision, sglang-kernel).
"""

import re
from importlib.metadata import requires

LEFT_OUT = re.compile(
    r"^(cuda-python|flash-attn|flashinfer|humming-kernels|nvidia-|nvshmem|sgl-deep|sgl-flash|quack-kernels|tilelang"
    r"|torch-memory-saver|torch_memory_saver|deepseek-recipe|smg-grpc|tml-renderers|timm|torchaudio|torchcodec|av"
    r"|decord2?|torch|torchvision|sglang-kernel)$",
    re.IGNORECASE,
)

for requirement in requires("sglang") or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
    if not LEFT_OUT.match(name):
        print(requirement)
