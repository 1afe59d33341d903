"""The shape the code keeps: short functions and classes (the run a table of contents), the argparse namespace seen
only by the entry points and the configs' `from_args` constructors (everything below takes typed configs), and
imports that point one way: no import cycle between modules nor between units (a subpackage of `megatron_ais`, a
top-level module, `kernels`), and no function-local import but of an optional heavy dependency — import statements
and imports made by call (`importlib.import_module`, `__import__`) alike."""
import ast
import os
import subprocess
import sys

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "megatron_ais")
OWN = ("megatron_ais", "kernels")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
# the run reads as a table of contents: its phases are calls into the objects that own them (weight sync, rollout
# schedule, checkpointer, fleet), its loop a dozen or so plain lines
MAX_RUN_CLASS_LINES, MAX_LOOP_LINES = 200, 20
# the only functions of the package that may take a parsed namespace
NAMESPACE_READERS = {"from_args", "flag_values", "plain_flag_values"}
# what a function may import locally: optional or heavy dependencies that a path of the package does without
# (vLLM in trainer-only paths, Triton without a GPU, wandb and matplotlib when not asked for, transformers at
# --help, math-verify outside the math task, Transformer Engine where it is not installed), each import with a
# comment saying why
LOCAL_IMPORT_ROOTS = {"vllm", "triton", "wandb", "matplotlib", "transformers", "math_verify", "transformer_engine"}
# +2: the import calls the checks now see (Transformer Engine's probe, the CPU shim's patched modules); +2: the vLLM
# modules whose 4-bit kernel selection the CPU engine replaces (ModelOpt NVFP4, compressed-tensors MXFP4); +2: the
# vLLM modules whose process launchers a separate CPU engine's fork server replaces (engine core, workers); +3: the
# vLLM modules whose 4-bit MoE methods the CPU engine replaces (the MoE method bases, ModelOpt, compressed-tensors)
MAX_LOCAL_IMPORTS = 46
# the CPU shim imports the megatron modules it patches when it patches (CPU only): `platform` stays light for the
# spawned ranks and workers that only ask which device and backend they have
LOCAL_IMPORTS_IN = {"megatron_ais.platform": {"megatron"}}
DYNAMIC = "<a module named at run time>"  # an import call whose argument the checks cannot read


def _modules(roots=OWN):
    """(dotted name, path, syntax tree) of every module under the packages `roots`."""
    for root in roots:
        for directory, _, files in os.walk(os.path.join(ROOT, root)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    with open(path) as f:
                        yield dotted, path, ast.parse(f.read(), path)


def _functions():
    for _, path, tree in _modules(("megatron_ais",)):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield os.path.relpath(path, ROOT), node


def test_no_function_is_longer_than_60_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def _classes():
    for _, path, tree in _modules(("megatron_ais",)):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                yield os.path.relpath(path, ROOT), node


def _lines(node) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_is_longer_than_250_lines_and_the_run_reads_as_a_table_of_contents():
    long = [f"{path}:{node.lineno} {node.name} ({_lines(node)} lines)" for path, node in _classes()
            if _lines(node) > MAX_CLASS_LINES]
    assert not long, long
    run = next(node for path, node in _classes() if node.name == "GRPORun")
    assert _lines(run) <= MAX_RUN_CLASS_LINES, _lines(run)
    loop = next(node for node in run.body if isinstance(node, ast.FunctionDef) and node.name == "run")
    assert _lines(loop) <= MAX_LOOP_LINES, _lines(loop)


def _takes_namespace(node) -> bool:
    params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    return any(p.arg == "args" or "Namespace" in ast.unparse(p.annotation or ast.Constant(None)) for p in params)


def test_only_from_args_constructors_read_the_namespace():
    readers = [f"{path}:{node.lineno} {node.name}" for path, node in _functions()
               if _takes_namespace(node) and node.name not in NAMESPACE_READERS]
    assert not readers, readers


def test_the_checks_see_what_they_should():
    """Negative control: the checks find a long function and a namespace parameter when there is one."""
    tree = ast.parse("def f(args):\n" + "    x = 1\n" * 70)
    node = tree.body[0]
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and _takes_namespace(node)


def _imported(node, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules an import statement of `module` names (`from a import b` names a.b when that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def _module_constants(tree) -> dict[str, object]:
    """The module-level names bound to a literal (e.g. a tuple of module names)."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return constants


def _loop_values(tree, call: ast.Call, name: str, constants: dict[str, object]) -> list | None:
    """What `name` takes in `call` as the target of a `for` over a module-level literal that holds the call, or
    None."""
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == name \
                and isinstance(node.iter, ast.Name) and isinstance(constants.get(node.iter.id), (tuple, list)) \
                and any(inner is call for inner in ast.walk(node)):
            return list(constants[node.iter.id])
    return None


def _called_imports(call: ast.Call, tree, constants: dict[str, object]) -> list[str] | None:
    """The modules an `importlib.import_module(...)` or `__import__(...)` call imports (its argument a literal, a
    module-level constant or a loop over one), DYNAMIC when the argument is none of these; None when `call` is not
    an import."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    argument = call.args[0]
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return [argument.value]
    if isinstance(argument, ast.Name) and isinstance(constants.get(argument.id), str):
        return [constants[argument.id]]
    values = _loop_values(tree, call, argument.id, constants) if isinstance(argument, ast.Name) else None
    return [v for v in values if isinstance(v, str)] if values else [DYNAMIC]


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str, bool]]]:
    """Our modules' imports of our modules ({module: imported modules}, wherever the import sits: statements and
    `importlib.import_module` / `__import__` calls), and every function-local import as (module, line, imported
    module, whether a comment gives its reason)."""
    modules = {dotted: (path, tree) for dotted, path, tree in _modules()}
    graph, local = {name: set() for name in modules}, []
    for name, (path, tree) in modules.items():
        with open(path) as f:
            lines = f.read().splitlines()
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _imported(node, name, path.endswith("__init__.py"), set(modules))
            elif isinstance(node, ast.Call):
                targets = _called_imports(node, tree, constants)
            else:
                targets = None
            if targets is None:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
            if id(node) in in_function or DYNAMIC in targets:
                reason = _commented(lines, node.lineno)
                local += [(name, node.lineno, target, reason) for target in dict.fromkeys(targets)]
    return graph, local


def _commented(lines: list[str], lineno: int) -> bool:
    """Whether a comment sits on the import's line or on the run of import and comment lines just above it."""
    index = lineno - 1
    while index >= 0:
        text = lines[index].strip()
        if index < lineno - 1 and not text.startswith(("import ", "from ", "#")):
            return False
        if "#" in text:
            return True
        index -= 1
    return False


def unit_of(module: str) -> str:
    """A subpackage of megatron_ais, a top-level module of it, or kernels."""
    parts = module.split(".")
    return parts[0] if parts[0] != "megatron_ais" else ".".join(parts[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as the list of its nodes (first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    return units


def test_no_import_cycle_between_modules():
    graph, _ = import_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_import_cycle_between_units():
    """Packages import each other one way: e.g. rollout/ may use bridge/, never the other way round."""
    units = unit_graph(import_graph()[0])
    assert find_cycle(units) is None, " -> ".join(find_cycle(units))


# the layers of docs/architecture.md, top first: a module imports its own layer's modules and those below, never one
# above (a module's layer: its longest prefix listed; kernels/ imports no module of the package)
LAYERS = (
    ("entry", ("megatron_ais.arguments", "megatron_ais.launch")),
    ("loop", ("megatron_ais.grpo",)),
    ("fleet", ("megatron_ais.rollout",)),
    ("engine", ("megatron_ais.engine",)),
    ("bridge", ("megatron_ais.bridge",)),
    ("trainer", ("megatron_ais.training", "megatron_ais.sft", "megatron_ais.initialize", "megatron_ais.kv_calibration",
                 "megatron_ais.refit_probe")),
    ("state", ("megatron_ais.checkpointing",)),
    ("model", ("megatron_ais.model", "megatron_ais.mapping")),
    ("algorithm", ("megatron_ais.grpo.loss", "megatron_ais.grpo.advantages", "megatron_ais.ais", "megatron_ais.data")),
    ("shared", ("megatron_ais",)),
    ("kernels", ("kernels",)),
)


def layer_of(module: str) -> int:
    prefixes = [(len(p), index) for index, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")]
    return max(prefixes)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                  for module, targets in graph.items() for target in targets if layer_of(target) < layer_of(module))


def test_imports_point_down_the_layers_and_the_map_names_them_in_order():
    assert upward_imports(import_graph()[0]) == []
    # a negative control: the trainer importing the fleet points up
    assert upward_imports({"megatron_ais.training": {"megatron_ais.rollout.fleet"}}) == [
        "megatron_ais.training (trainer) imports megatron_ais.rollout.fleet (fleet)"]
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    block = text[text.index("## Layers"):]
    block = block[block.index("```") + 3:]
    rows = [line.split()[0] for line in block[:block.index("```")].splitlines() if line and not line[0].isspace()]
    assert rows == [name for name, _ in LAYERS], rows


def test_function_local_imports_only_of_optional_heavy_dependencies():
    _, local = import_graph()
    own = [f"{module}:{line} {target}" for module, line, target, _ in local if target.startswith(OWN)]
    assert not own, f"function-local imports of our own modules (import at the top; break a cycle by moving " \
                    f"the shared thing down): {own}"
    other = [f"{module}:{line} {target}" for module, line, target, _ in local
             if target.split(".")[0] not in LOCAL_IMPORT_ROOTS | LOCAL_IMPORTS_IN.get(module, set())]
    assert not other, f"function-local imports of dependencies every path needs: {other}"
    unexplained = [f"{module}:{line} {target}" for module, line, target, reason in local if not reason]
    assert not unexplained, f"function-local imports without a comment saying why: {unexplained}"
    sites = {(module, line) for module, line, _, _ in local}
    assert len(sites) <= MAX_LOCAL_IMPORTS, f"{len(sites)} function-local imports (cap {MAX_LOCAL_IMPORTS})"


def test_the_engine_workers_load_no_megatron():
    """vLLM's worker processes import our worker extension and plugin, every spawned rank `distributed` and
    `platform`: none may pull in megatron-core (seconds per process start) through a shared module."""
    code = ("import sys; import megatron_ais.engine.worker_extension, megatron_ais.engine.vllm_plugin, "
            "megatron_ais.distributed, megatron_ais.platform; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_the_import_checks_see_a_cycle():
    """Negative control: a planted cycle between modules, and one between units through different modules."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    planted = {"megatron_ais.rollout.fleet": {"megatron_ais.bridge.sync"},
               "megatron_ais.bridge.node_copies": {"megatron_ais.rollout.rows"}}
    assert find_cycle(planted) is None
    assert find_cycle(unit_graph(planted)) == ["megatron_ais.bridge", "megatron_ais.rollout", "megatron_ais.bridge"]
    assert _commented(["def f():", "    # vLLM: workers only", "    import vllm", "    import vllm.utils"], 4)
    assert not _commented(["def f():", "    x = 1  # one", "    import vllm"], 3)
    tree = ast.parse("def f():\n    from megatron_ais.rollout import fleet\n")
    assert _imported(tree.body[0].body[0], "megatron_ais.grpo.run", False, {"megatron_ais.rollout.fleet"}) == \
        ["megatron_ais.rollout.fleet"]


def test_the_import_checks_see_imports_made_by_call():
    """Negative control: `importlib.import_module`, `import_module` and `__import__` with a literal, a module-level
    constant or a loop over one name their modules; any other argument is an import the checks cannot read."""
    tree = ast.parse("import importlib\nfrom importlib import import_module\nNAME = 'megatron_ais.grpo.run'\n"
                     "NAMES = ('megatron_ais.sft', 'vllm')\n"
                     "def f(x):\n    importlib.import_module('megatron_ais.rollout.fleet')\n"
                     "    __import__('megatron_ais.bridge.sync')\n    import_module(NAME)\n"
                     "    for name in NAMES:\n        import_module(name)\n    import_module(x)\n    print(x)\n"
                     "def g(name):\n    import_module(name)\n")
    constants = _module_constants(tree)
    calls = sorted((node for node in ast.walk(tree) if isinstance(node, ast.Call)), key=lambda call: call.lineno)
    assert [_called_imports(call, tree, constants) for call in calls] == [
        ["megatron_ais.rollout.fleet"], ["megatron_ais.bridge.sync"], ["megatron_ais.grpo.run"],
        ["megatron_ais.sft", "vllm"], [DYNAMIC], None, [DYNAMIC]]
