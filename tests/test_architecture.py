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


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported_names(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from glm_dsa... import name`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("glm_dsa"):
            out.extend((node.module, a.name) for a in node.names)
    return out


def _defined_functions(path: pathlib.Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_kernels_and_peers_import_nothing_private():
    files = sorted((PACKAGE / "kernels").glob("*.py")) + [PACKAGE / "peers.py", PACKAGE / "backend.py"]
    private = [(f.name, m, n) for f in files for m, n in _imported_names(f) if n.startswith("_")]
    assert private == []
    assert any(m == "glm_dsa.validate" for m, _ in _imported_names(PACKAGE / "kernels" / "mqa_logits.py"))


def test_no_module_imports_a_private_name_of_another():
    private = [(f.relative_to(PACKAGE).as_posix(), m, n) for f in _modules()
               for m, n in _imported_names(f)
               if n.startswith("_") and not n.startswith("__") and m != "glm_dsa.kernels._interpreter"]
    assert private == []


def test_the_validation_module_is_the_only_definer_of_the_contract_checks():
    """One ``need`` (the idiom), and each contract check defined once, in glm_dsa/validate.py."""
    shared = {n for n in _defined_functions(PACKAGE / "validate.py") if n.startswith("check_")}
    assert {"check_sparse_inputs", "check_logits_inputs", "check_ranges", "check_paged_inputs"} <= shared
    for f in _modules():
        if f.name == "validate.py":
            continue
        defined = _defined_functions(f)
        assert not defined & {"need", "_need"}, f
        assert not {n.lstrip("_") for n in defined} & shared, f


def test_the_oracle_the_model_and_the_kernels_call_the_validation_module():
    users = {f.relative_to(PACKAGE).as_posix() for f in _modules()
             if any(m == "glm_dsa.validate" for m, _ in _imported_names(f))}
    assert {"oracle.py", "indexer.py", "mla.py", "kernels/mqa_logits.py", "kernels/topk.py",
            "kernels/sparse_mla.py", "kernels/indexer.py"} <= users


def test_range_checks_never_copy_index_vectors_to_the_host():
    """``check_ranges`` takes tensors: no call site hands it ``.tolist()`` lists; and no check in
    validate.py copies a tensor to the host as a list (a failing row's numbers are read one by
    one, to be named)."""
    for f in _modules():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "check_ranges":
                assert not any("tolist" in ast.unparse(a) for a in node.args), f
    tree = ast.parse((PACKAGE / "validate.py").read_text())
    copies = [ast.unparse(n) for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr in ("tolist", "numpy", "cpu")]
    assert copies == []
    assert any(isinstance(n, ast.FunctionDef) and n.name == "check_paged_inputs" for n in tree.body)


def test_the_layer_never_picks_the_attention_form_itself():
    """The backend decides: layer.py calls ``backend.attend`` and never inspects the backend."""
    source = (PACKAGE / "layer.py").read_text()
    assert "backend.attend(" in source
    for probe in ("paged_sparse_mla", "backend.name", "forward_paged", "read_mla", "isinstance(step.backend"):
        assert probe not in source, probe


def _bytes_to_rows(path: pathlib.Path) -> list[str]:
    """Every floor division of a byte count (an operand naming bytes or a budget) in ``path``:
    a rule turning bytes into rows."""
    return [f"{path.name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.FloorDiv)
            and any(w in ast.unparse(n.left).lower() for w in ("bytes", "budget"))]


def test_the_budgets_have_one_home():
    """``max_logit_rows``, ``attention_rows``, ``moe_rows`` and ``rows_within`` are defined in
    budget.py only, and no other module turns bytes into rows by a rule of its own: no floor
    division of a byte count outside budget.py (the ledger re-derives the logits rule from the
    config on purpose, as a cross-check its tests hold against budget.py)."""
    for f in _modules():
        defined = _defined_functions(f)
        if f.name != "budget.py":
            assert not defined & {"max_logit_rows", "attention_rows", "moe_rows", "rows_within",
                                  "logits_budget_bytes", "_rows_per_chunk", "default_budget_bytes"}, f
    rules = [r for f in _modules() if f.name not in ("budget.py", "ledger.py") for r in _bytes_to_rows(f)]
    assert rules == []
    assert _bytes_to_rows(PACKAGE / "budget.py")  # the check sees such divisions at all


# ----------------------------------------------------------------------------- import graph
def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports, at module level or inside a function (both run),
    leaving out ``if TYPE_CHECKING:`` blocks (they never run). ``from a import b`` names the
    module ``a.b`` when there is one; importing ``a.b`` from outside package ``a`` runs
    ``a/__init__.py`` too, so that counts as importing ``a`` (the top-level ``glm_dsa``, the
    public façade that imports everything, is left out)."""
    modules = {_module_name(p): p for p in _modules()}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            else:
                continue
            for target in targets:
                while target in modules and target != "glm_dsa":
                    edges.add(target)
                    target = target.rpartition(".")[0]
                    if name.startswith(target + "."):
                        break
        graph[name] = edges - {name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


# A loop merged from main while glm_dsa/testing/ is being reworked there: check.py and
# mistakes.py import each other inside functions (expected_outputs / diagnose). Delete this
# entry once one of the two moves below the other; nothing else may loop.
def test_no_import_cycle_among_the_package_modules():
    graph = _import_graph()
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert not cycles, cycles
    assert "glm_dsa.row_chunks" in graph["glm_dsa.kernels.indexer"]  # the check sees imports at all


def test_the_kernels_import_nothing_of_the_model():
    """``glm_dsa/kernels/*`` sits below the model: nothing it imports, directly or through
    another module, defines an ``nn.Module`` (the reference ``indexer.py`` among them)."""
    graph = _import_graph()
    model = {_module_name(p) for p in _modules()
             if any(isinstance(n, ast.ClassDef) and any("Module" in ast.unparse(b) for b in n.bases)
                    for n in ast.walk(ast.parse(p.read_text())))}
    assert {"glm_dsa.indexer", "glm_dsa.mla", "glm_dsa.moe", "glm_dsa.layer"} <= model
    for kernel in (m for m in graph if m.startswith("glm_dsa.kernels")):
        assert not _reachable(graph, kernel) & model, kernel


def test_the_model_reaches_the_kernels_through_the_backend_and_the_fused_passes_only():
    importers = {m for m, edges in _import_graph().items()
                 if not m.startswith("glm_dsa.kernels") and any(e.startswith("glm_dsa.kernels") for e in edges)}
    assert importers == {"glm_dsa.backend", "glm_dsa.fused", "glm_dsa.peers"}, importers


# ----------------------------------------------------------------------------- backends
_BACKEND_NAMES = {"auto", "reference", "triton", "peers"}


def test_capabilities_are_backend_attributes_and_no_other_module_lists_backends():
    """What a backend can do is an attribute of it: no module but backend.py compares with a
    backend's name or holds backend names in a tuple, list or set."""
    from glm_dsa.backend import Backend, PeersBackend, ReferenceBackend, TritonBackend

    for attr in ("graph_capturable", "batch_invariant", "activation_dtypes", "kv_dtypes", "passes"):
        assert hasattr(Backend, attr), attr
    assert (ReferenceBackend.batch_invariant, TritonBackend.graph_capturable) == (True, True)
    assert PeersBackend.activation_dtypes is not None
    offenders = []
    for f in _modules():
        if f.name == "backend.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare):
                operands, least = [node.left, *node.comparators], 1
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                # A list of backends names two of them; one word among other strings (the
                # "reference" key of a flashinfer-bench definition) is not one.
                operands, least = list(node.elts), 2
            else:
                continue
            names = [c for c in operands if isinstance(c, ast.Constant) and c.value in _BACKEND_NAMES]
            if len(names) >= least:
                offenders.append(f"{f.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def test_no_module_inspects_or_sets_torch_forward_hooks():
    """A step is observed through ``glm_dsa.layer.StepObserver``: nothing in the package reads
    torch's private hook dicts or registers a forward hook (which a replayed graph skips)."""
    probes = ("_global_forward_hooks", "_global_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks",
              "register_forward_hook", "register_forward_pre_hook", "register_module_forward_hook")
    found = [(f.relative_to(PACKAGE).as_posix(), p) for f in _modules() for p in probes if p in f.read_text()]
    assert found == []
    assert "StepObserver" in (PACKAGE / "fidelity.py").read_text()  # the check reads the right files


def test_no_class_is_defined_twice_and_check_names_have_one_meaning():
    """One definition per class name in the package, and ``check_outputs`` / ``check_device``
    each mean one thing (golden outputs; a ``--device`` flag)."""
    classes: dict[str, list[str]] = {}
    for f in _modules():
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(f.relative_to(PACKAGE).as_posix())
    assert {name: where for name, where in classes.items() if len(where) > 1} == {}
    for name, home in (("check_outputs", "testing/golden.py"), ("check_device", "preflight.py")):
        definers = [f.relative_to(PACKAGE).as_posix() for f in _modules() if name in _defined_functions(f)]
        assert definers == [home], (name, definers)


def test_each_data_check_is_written_once_for_both_modes():
    """``syncfree.check`` serves eager and sync-free steps alike: no check sits in a branch on
    ``syncfree.active()`` (which only chooses a plan from sizes)."""
    doubled = []
    for f in _modules():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.If) and "syncfree.active()" in ast.unparse(node.test):
                if any("syncfree.check(" in ast.unparse(s) for s in node.body + node.orelse):
                    doubled.append(f"{f.relative_to(PACKAGE)}:{node.lineno}")
    assert doubled == []
