"""Ahead-of-time compilation of every Triton kernel specialization the package can launch, for
A100 (sm_80) and H100 (sm_90), on any machine: no GPU and no driver needed (Triton ships
``ptxas``, ``cuobjdump`` and ``nvdisasm``).

What is compiled is ``_triton.LAUNCHES`` — the table the launcher itself checks every launch
against — so a kernel that the launcher can reach and that does not compile for a target is
found here, not by a user's first ``step()``. From each cubin it reads:

* registers per thread and local memory from ``cuobjdump --dump-resource-usage``, and spills
  as the SASS's local loads and stores (``LDL``/``STL``: what ``ptxas -v`` counts as spill
  loads and stores, including the return-address saves of a subroutine call);
* global access widths from the SASS (``LDG.E.128``/``STG.E.128`` are 128-bit, ``LDG.E.64``
  64-bit, ``LDG.E``/``STG.E`` 32-bit);
* from the Triton IR, the element streams of the full-block loop: the loads and stores whose
  pointers carry the alignment hint (``tt.divisibility``), by element type, against the
  unhinted ones of the masked rest.

``wide_ok`` holds when the full-block loop reads and writes every element stream through hinted
pointers (as many hinted accesses as masked ones) and the SASS has at least one 128-bit access
per hinted fp32 stream (64-bit per bf16/fp16 stream), loads and stores counted apart.

Run ``python -m vrgd_ds.optim.triton_aot`` (a table; ``--json FILE`` writes every record;
exit status 1 when a case fails a check). ``TRITON_INTERPRET`` must be unset: the interpreter
replaces the kernels with Python functions that cannot be compiled.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

ARCHS = (80, 90)  # A100, H100
MAX_REGISTERS = 128  # 4 warps x 128 registers x 4 blocks fill an SM's 64k registers
_LOCAL_ACCESS = re.compile(r"\b(?:LDL|STL)\b")
_SASS_ACCESS = re.compile(r"\b((?:LDG|STG)\.E(?:\.[A-Z0-9_]+)*)\b")
_HINTED = re.compile(r"(%[\w.]+) = tt\.addptr .*tt\.divisibility = dense<(\d+)>")
_ACCESS = re.compile(r"\btt\.(load|store) (%[\w.]+)[^:]*: tensor<\d+x!tt\.ptr<(\w+)>")


def cases() -> list[tuple[str, dict[str, Any]]]:
    """Every (launch name, constexpr flags) of ``LAUNCHES``."""
    from vrgd_ds.optim import _triton

    return [(name, dict(flags)) for name, spec in _triton.LAUNCHES.items() for flags in spec.cases]


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _ir_streams(ttir: str) -> dict[str, Counter]:
    """Element-tensor loads/stores of the kernel by (kind, element type), hinted or not."""
    hinted = {m.group(1) for m in _HINTED.finditer(ttir)}
    out = {"hinted": Counter(), "masked": Counter()}
    for m in _ACCESS.finditer(ttir):
        kind, ptr, ety = m.groups()
        out["hinted" if ptr in hinted else "masked"][(kind, ety)] += 1
    return out


def compile_case(name: str, flags: dict[str, Any], arch: int) -> dict[str, Any]:
    """Compiles one specialization for ``sm_<arch>`` and reads its resources and accesses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vrgd_ds.optim import _triton

    if _triton.INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 is set: unset it to compile the kernels")
    spec = _triton.LAUNCHES[name]
    kernel = spec.kernel
    signature = {p.name: "constexpr" if p.is_constexpr else p.annotation_type for p in kernel.params}
    missing = [n for n, t in signature.items() if not t]
    if missing:
        raise TypeError(f"{kernel.__name__}: parameters {missing} have no type annotation")
    record: dict[str, Any] = {"launch": name, "kernel": kernel.__name__, "arch": arch,
                              "flags": {k: str(v) for k, v in flags.items()}, "num_warps": spec.num_warps}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, flags), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": spec.num_warps, "enable_fp_fusion": False})
    except Exception as exc:  # the compiler's message is the result
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        return record
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(_tools(), "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(_tools(), "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    res = dict(re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", usage))
    widths = Counter(_SASS_ACCESS.findall(sass))
    streams = _ir_streams(compiled.asm["ttir"])
    record.update(ok=True, registers=int(res["REG"]), local_bytes=int(res["LOCAL"]), stack_bytes=int(res["STACK"]),
                  local_accesses=len(_LOCAL_ACCESS.findall(sass)),
                  shared_bytes=int(res["SHARED"]), sass_accesses=dict(sorted(widths.items())),
                  body_streams={f"{k}:{t}": n for (k, t), n in sorted(streams["hinted"].items())},
                  rest_streams={f"{k}:{t}": n for (k, t), n in sorted(streams["masked"].items())})
    record["wide_ok"] = _wide_ok(streams, widths)
    return record


def _wide_ok(streams: dict[str, Counter], widths: Counter) -> bool | None:
    """None for a kernel without a full-block loop (scalar reductions, unaligned hook variants)."""
    hinted, masked = streams["hinted"], streams["masked"]
    if not hinted:
        return None
    if set(hinted) != set(masked):  # a stream the body reaches without the hint, or that the rest does not have
        return False
    for kind, op in (("load", "LDG.E"), ("store", "STG.E")):
        need128 = sum(n for (k, t), n in hinted.items() if k == kind and t == "f32")
        need64 = sum(n for (k, t), n in hinted.items() if k == kind and t in ("bf16", "f16"))
        got128 = sum(n for w, n in widths.items() if w.startswith(op + ".128"))
        got64 = sum(n for w, n in widths.items() if w.startswith(op + ".64"))
        if got128 < need128 or got64 < need64:
            return False
    return True


def _run(args: tuple[str, dict[str, Any], int]) -> dict[str, Any]:
    return compile_case(*args)


def check(jobs: int | None = None) -> list[dict[str, Any]]:
    """Every case for every target, compiled in ``jobs`` processes."""
    todo = [(name, flags, arch) for name, flags in cases() for arch in ARCHS]
    jobs = jobs or min(len(todo), os.cpu_count() or 1)
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_run, todo, chunksize=4))


def failures(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        what = f"{r['launch']} {r['flags']} sm_{r['arch']}"
        if not r["ok"]:
            out.append(f"{what}: does not compile: {r['error'].splitlines()[0]}")
            continue
        if r["local_bytes"] or r["local_accesses"]:
            out.append(f"{what}: spills ({r['local_accesses']} local loads/stores in the SASS, "
                       f"{r['local_bytes']} B local)")
        if r["registers"] > MAX_REGISTERS:
            out.append(f"{what}: {r['registers']} registers > {MAX_REGISTERS}")
        if r["wide_ok"] is False:
            out.append(f"{what}: full-block loop not 128-bit: body {r['body_streams']}, rest {r['rest_streams']}, "
                       f"SASS {r['sass_accesses']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m vrgd_ds.optim.triton_aot")
    ap.add_argument("--json", help="write every record to this file")
    ap.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per core)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("triton_aot: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)", file=sys.stderr)
        return 2
    import triton

    records = check(args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "records": records}, f, indent=1)
    by = {}
    for r in records:
        k = (r["launch"], r["arch"])
        by.setdefault(k, []).append(r)
    print(f"Triton {triton.__version__}: {len(records)} compilations")
    print(f"{'launch':<13} {'sm':>3} {'cases':>5} {'ok':>3} {'max reg':>7} {'spills':>6} {'128-bit body':>12}")
    for (launch, arch), rs in by.items():
        ok = [r for r in rs if r["ok"]]
        wide = [r["wide_ok"] for r in ok if r["wide_ok"] is not None]
        spilled = sum(bool(r["local_bytes"] or r["local_accesses"]) for r in ok)
        print(f"{launch:<13} {arch:>3} {len(rs):>5} {len(ok):>3} {max((r['registers'] for r in ok), default=0):>7} "
              f"{spilled:>6} {f'{sum(wide)}/{len(wide)}' if wide else '-':>12}")
    bad = failures(records)
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
