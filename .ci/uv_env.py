"""Print the ``export UV_...`` lines that give uv the package sources pip has on this machine.

.ci/install_engines installs SGLang and vLLM with uv (about 3 minutes, byte-compiled, where pip
took about 9: pip unpacks and byte-compiles some 11 GB on one core). This keeps uv to pip's sources: the index,
extra indexes, find-links, constraints and certificate of ``pip config list`` (files and PIP_*
variables), and pip's choice of the best version across them (``unsafe-best-match``).
"""

import re
import shlex
import subprocess
import sys

AS_UV = {
    "index-url": ("UV_DEFAULT_INDEX", " "),
    "extra-index-url": ("UV_INDEX", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", None),
}
"""pip's setting: uv's variable and how it separates several values (None: one value)."""

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
settings: dict[str, str] = {}
for line in listing.stdout.splitlines():  # global.extra-index-url='a b', then :env:.find-links='c' (later wins)
    found = re.fullmatch(r"[^.]*\.([\w-]+)='(.*)'", line.strip())
    if found and found[1] in AS_UV:
        settings[found[1]] = found[2]
print("export UV_INDEX_STRATEGY=unsafe-best-match")
for key, value in settings.items():
    name, separator = AS_UV[key]
    print(f"export {name}={shlex.quote(separator.join(value.split()) if separator else value)}")
