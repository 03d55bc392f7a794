#!/usr/bin/env bash
# Wheels the GPU machine lacks for the grammar backends and GGUF checkpoints (xgrammar and its
# tvm-ffi, llguidance, gguf) and for the LoRA tests and gate row (peft, accelerate), for its Python 3.12, into .whl/ (kept out of git); scripts/gpu_suite.sh
# installs them there into /tmp/site.  And the embedded SmolLM2 GGUF (98 MB, over one call's 64 MiB)
# in two parts, .gg1/ and .gg2/ (with its sha256): carry .gg1 in one call and .gg2 in the next while
# the machine is warm; the real_model stage joins and checks them.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PY:-.venv/bin/python}
for d in .whl .gg1 .gg2; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
ver() { "$py" -m pip show "$1" | sed -n 's/^Version: //p'; }
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
  "xgrammar==$(ver xgrammar)" "apache-tvm-ffi==$(ver apache-tvm-ffi)" "llguidance==$(ver llguidance)" "gguf==$(ver gguf)" \
  "peft==$(ver peft)" "accelerate==$(ver accelerate)"
gguf=$("$py" -c "from ray_attn.presets import default_gguf; print(default_gguf())")
rm -rf .gg1 .gg2 && mkdir .gg1 .gg2
split -b 56000000 "$gguf" .gg1/part_
mv .gg1/part_ab .gg2/part_ab
sha256sum "$gguf" | cut -c1-64 > .gg2/sha256
du -sh .whl .gg1 .gg2
