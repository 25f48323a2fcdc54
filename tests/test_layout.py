"""The op folder's layout (docs/development.md): lowerings/linear_logprobs's modules import one
another without a cycle, so each layer can be read (and changed) below the ones that use it, and
tuning.py is the one place both CUDA paths read their tiles and budgets from.

Read from the source (ast), not by importing: a cycle Python tolerates at import time (a module
read half-initialized) is still a cycle."""
import ast
import pathlib

import lowerings.linear_logprobs as pkg

ROOT = pathlib.Path(pkg.__file__).parent
PREFIX = "lowerings.linear_logprobs"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        name = ".".join((PREFIX,) + parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: pathlib.Path, mods: dict) -> set[str]:
    """Every package module this file imports, at any depth of the file (function-local imports
    count: they are deferred, not absent)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in mods else node.module)
    return {m for m in found if m in mods and m != PREFIX}


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    state: dict[str, int] = {}   # 1 on the stack, 2 done

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_tile_tables_live_in_tuning_only():
    """The tables and budgets both CUDA paths read are defined once, in tuning.py: a second
    definition (as recompute/dense.py held before the move) would take a patch on one and not the
    other."""
    names = {"TILES", "GEMM_TILES", "DW_TILES", "GROUP_N", "CHUNK_V", "DX_GROUP_BYTES", "MAX_STEPS",
             "MAX_ROW_GROUPS", "TMA", "DW_TMA_OUT", "COMBINE_TILE"}
    owners = {}
    for m, p in _modules().items():
        if "kernels" in m or m.endswith(".cpu"):   # the CPU body's own CHUNK_V / budgets
            continue
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id in names:
                        owners.setdefault(t.id, []).append(m)
    assert owners and all(v == [f"{PREFIX}.tuning"] for v in owners.values()), owners
