#!/usr/bin/env bash
# Fills DIR (default .whl) with the wheels benchmarks/gpu_suite.sh installs on a GPU machine that
# cannot reach a package index: what its image lacks (DeepSpeed 0.19.8, megatron-core 0.16.1,
# pydantic with its needs, hjson) and what it holds at another release (sentencepiece: the release
# pyproject.toml pins, whose tokenizers the study records carry). For CPython 3.12 on x86-64 Linux.
# DeepSpeed publishes no wheel: it is built here, by the project's interpreter (it imports torch to
# build; no op is compiled).
#
#   bash benchmarks/gpu_wheels.sh [DIR]       (about 8 MB; run from the checkout, after make install)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$dir"
rm -f "$dir"/*.whl  # one release of each: two stop the install there
trainer=$("$python" -c "from vrgd_ds.data_pipeline.tokenizer import TRAINER_RELEASE; print(TRAINER_RELEASE)")
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" deepspeed==0.19.8
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir" megatron-core==0.16.1 "sentencepiece==$trainer" hjson "pydantic==2.14.4" \
    "pydantic-core==2.50.5" annotated-types typing-inspection "typing-extensions>=4.16"
ls "$dir"
