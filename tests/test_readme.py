"""README.md's and docs/'s `python` blocks run as written: the README's in order, in one namespace
(as a reader pastes them into one session), on this machine's device; each docs page continues
that session (a copy of the README's namespace), its blocks in order. Blocks whose first line is
`# sketch` need a trainer, several processes or a GPU and are only compiled (syntax-checked)."""
import pathlib
import re

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 350


def _blocks(path: pathlib.Path):
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def _run(path: pathlib.Path, namespace: dict) -> int:
    ran = 0
    for line, code in _blocks(path):
        compiled = compile(code, f"{path.relative_to(ROOT)}:{line}", "exec")
        if code.startswith("# sketch"):
            continue
        exec(compiled, namespace)   # noqa: S102 (the project's own documentation code)
        ran += 1
    return ran


@pytest.fixture(scope="module")
def readme_session():
    namespace: dict = {}
    ran = _run(README, namespace)
    torch._dynamo.reset()
    return namespace, ran


def test_readme_python_blocks_run(readme_session):
    namespace, ran = readme_session
    assert ran >= 1
    assert namespace["out"].loss.isfinite()   # the quickstart's compiled step


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    for page in re.findall(r"`(docs/[\w-]+\.md)`", README.read_text()):
        assert (ROOT / page).is_file(), page


@pytest.mark.parametrize("page", DOCS, ids=[p.stem for p in DOCS])
def test_docs_python_blocks_run(page, readme_session):
    namespace = dict(readme_session[0])
    torch._dynamo.utils.counters.clear()
    # caches off: on an FX-graph or autograd cache hit the pre-grad pass does not run (the cached
    # graph is already the fused one) and counts nothing
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _run(page, namespace)
    if page.stem == "inductor-pass":    # the pass fired on the page's naive code
        assert torch._dynamo.utils.counters["compiled_grpo"]["naive_logprob_fusion"] == 1
    if page.stem == "packed":           # the packed GSPO call
        assert namespace["out"].loss.isfinite() and namespace["out"] is not readme_session[0]["out"]
    torch._dynamo.reset()


def test_docs_examples_ran():
    """The pages with code that runs (not only sketches) are the ones expected."""
    runnable = {p.stem for p in DOCS if any(not c.startswith("# sketch") for _, c in _blocks(p))}
    assert {"packed", "losses-and-metrics", "inductor-pass"} <= runnable, runnable


def test_op_package_map_names_every_module():
    """lowerings/linear_logprobs/__init__.py's docstring is the op folder's map: every module, in
    its subpackage (recompute/, fused/, launching/), and the kernels/ folder are named there, so a
    newcomer can walk the tree from it."""
    import lowerings.linear_logprobs as pkg
    folder = pathlib.Path(pkg.__file__).parent
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*.py")
             if p.name != "__init__.py" and "kernels" not in p.parts and "__pycache__" not in p.parts]
    names += ["kernels/"]
    missing = [n for n in names if n not in pkg.__doc__]
    assert not missing, missing
