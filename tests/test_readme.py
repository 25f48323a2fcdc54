"""README.md's `python` blocks run as written: in order, in one namespace (as a reader pastes them
into one session), on this machine's device. Blocks whose first line is `# sketch` need a trainer,
several processes or a GPU and are only compiled (syntax-checked)."""
import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks():
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def test_readme_python_blocks_run():
    blocks = _blocks()
    assert len(blocks) >= 7
    namespace: dict = {}
    ran = 0
    for line, code in blocks:
        compiled = compile(code, f"README.md:{line}", "exec")
        if code.startswith("# sketch"):
            continue
        exec(compiled, namespace)   # noqa: S102 (the README's own code)
        ran += 1
    torch._dynamo.reset()
    assert ran >= 3
    assert namespace["out"].loss.isfinite()   # the packed GSPO call's loss
