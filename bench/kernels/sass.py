"""The sm_90 SASS of one aot_check launch configuration, and the instructions of its main loop:
what an epilogue costs an element, read on any machine (no GPU), through the nvdisasm that the
triton wheel ships beside ptxas.

    python -m bench.kernels.sass ["forward, fused, STORE_E, WITH_ENTROPY=False"] [--out FILE]

Prints the kernel's instruction count, its main loop's (the innermost loop holding the HGMMAs:
in a flattened (tile, K step) loop that is one K step plus, behind a branch, the tile's
epilogue) and the loop's opcodes by count. A logits tile is 128 x 256 on 256 threads, 128
elements a thread: 2000 instructions in the loop are ~15 an element. The labels are
aot_check.cases()'s (that module's tiles and flags).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

from triton import knobs

from bench.kernels import aot_check

_INSN = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def sass(label: str) -> str:
    """nvdisasm's SASS of aot_check's case `label`."""
    for name, fn, consts, num_warps, num_stages in aot_check.cases():
        if name != label:
            continue
        c = aot_check.build(fn, consts, num_warps, num_stages)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(c.asm["cubin"])
            nvdisasm = knobs.nvidia.nvdisasm.path   # the wheel's, beside its ptxas
            return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                                  check=True).stdout
    raise KeyError(f"no aot_check case {label!r}")


def loop_ops(text: str) -> tuple[int, collections.Counter]:
    """(instructions of the kernel, opcodes of its main loop): the loop is a label and the last
    branch back to it, the smallest such span that holds an HGMMA."""
    lines = text.splitlines()
    labels, insns = {}, []
    for line in lines:
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if m:
            insns.append((m.group(2), m.group(3)))
    best = None
    for i, (op, rest) in enumerate(insns):
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op == "BRA" and target and labels.get(target.group(1), i + 1) <= i:
            span = insns[labels[target.group(1)]:i + 1]
            if any(o.startswith("HGMMA") for o, _ in span) and (best is None or len(span) < len(best)):
                best = span
    return len(insns), collections.Counter(op for op, _ in best or [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label", nargs="?", default="forward, fused, STORE_E, WITH_ENTROPY=False")
    ap.add_argument("--out", help="write the SASS there")
    args = ap.parse_args()
    text = sass(args.label)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    total, ops = loop_ops(text)
    local = sum(n for op, n in ops.items() if op.startswith(("LDL", "STL")))
    print(f"{args.label}: {total} instructions, main loop {sum(ops.values())}, "
          f"{local} of them local-memory (spill) loads / stores")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(24)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
