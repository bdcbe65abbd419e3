"""Module boundaries that the layout promises: parallelism beside the model, not inside it."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "glm_dsa"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_only_the_drivers_import_the_context_parallel_module():
    importers = {p.name for p in PACKAGE.glob("*.py") if "glm_dsa.cp" in _imports(p)}
    assert importers <= {"cp.py", "prefill.py", "cli.py"}, importers
    assert "cli.py" in importers  # the check sees imports at all


def test_the_ledger_defines_no_name_another_module_owns():
    tree = ast.parse((PACKAGE / "ledger.py").read_text())
    defined = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
               if isinstance(t, ast.Name)}
    defined |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    owned = {"CP_SPLITS", "KV_DTYPES", "MLA_KV_FORMATS", "NO_CHUNK_LOGITS",
             "LOGITS_NO_CHUNK_ELEMENTS", "index_k_page_bytes", "_table", "table"}
    assert not defined & owned
    assert "build_ledger" in defined  # the check sees definitions at all
