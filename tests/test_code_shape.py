"""The shape the code keeps: short functions, and the argparse namespace seen only by the entry points and the
configs' `from_args` constructors (everything below takes typed configs)."""
import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "megatron_ais")
MAX_FUNCTION_LINES = 60
# the only functions of the package that may take a parsed namespace
NAMESPACE_READERS = {"from_args", "flag_values", "plain_flag_values"}


def _functions():
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield os.path.relpath(path, ROOT), node


def test_no_function_is_longer_than_60_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


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
