#!/usr/bin/env bash
# Lays this checkout out as the installed package is laid out, in DIR (default /tmp/vrgd_src): the
# top-level data_pipeline/ is vrgd_ds.data_pipeline (pyproject.toml [tool.setuptools.package-dir]).
# Links, not copies: DIR/vrgd_ds holds a link to each entry of vrgd_ds/ and to data_pipeline/. Put DIR
# first on PYTHONPATH where the project is not installed (a GPU image's packages from wheels):
#
#   export PYTHONPATH=$(bash benchmarks/source_tree.sh):$PYTHONPATH
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/vrgd_src}
rm -rf "$dir/vrgd_ds"
mkdir -p "$dir/vrgd_ds"
for entry in "$root"/vrgd_ds/*; do
    [[ $(basename "$entry") == __pycache__ ]] || ln -s "$entry" "$dir/vrgd_ds/$(basename "$entry")"
done
ln -s "$root/data_pipeline" "$dir/vrgd_ds/data_pipeline"
echo "$dir"
