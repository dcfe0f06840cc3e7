"""Limits that keep the source readable: no function over 150 lines, no public function or
constructor over 10 parameters, and every import written inside a function says why (a
comment on it, on the block of imports it belongs to, or on the function's first import: an
import cycle, the CLI's start-up time, an optional dependency)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "protrain"
MAX_LINES = 150
MAX_PARAMS = 10


def _modules() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        out.append((path, text, ast.parse(text)))
    return out


def _functions(tree: ast.Module):
    """Every function, with whether it is public: a module's or a public class's, not
    nested in a function, named without a leading underscore (``__init__`` included)."""
    todo = [(node, True) for node in tree.body]
    while todo:
        node, public_scope = todo.pop()
        if isinstance(node, ast.ClassDef):
            public = public_scope and not node.name.startswith("_")
            todo += [(child, public) for child in node.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = node.name
            yield node, public_scope and (not name.startswith("_") or name == "__init__")
            todo += [(child, False) for child in ast.walk(node) if child is not node]


def _params(node: ast.FunctionDef) -> int:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(SRC.parent)}:{node.lineno}"


def test_no_function_is_over_150_lines():
    long = [
        f"{_where(path, node)} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, _, tree in _modules()
        for node, _ in _functions(tree)
        if node.end_lineno - node.lineno + 1 > MAX_LINES
    ]
    assert not long, long


def test_no_public_function_has_over_10_parameters():
    many = [
        f"{_where(path, node)} {node.name} ({_params(node)} parameters)"
        for path, _, tree in _modules()
        for node, public in _functions(tree)
        if public and _params(node) > MAX_PARAMS
    ]
    assert not many, many


def _says_why(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's lines, or on a line just above its block of imports."""
    if any("#" in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
        return True
    i = node.lineno - 2
    while i >= 0:
        line = lines[i].strip()
        if line.startswith("#") or "#" in line and line.startswith(("import ", "from ")):
            return True
        if not line.startswith(("import ", "from ")) and not line.endswith((",", "(", ")")):
            return False
        i -= 1
    return False


def _imports_in(node: ast.AST) -> list[ast.stmt]:
    found = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted(found, key=lambda n: n.lineno)


def test_every_import_inside_a_function_says_why():
    """The first import of a function says why; one comment may cover the function's
    later imports (a command's lazy imports, say)."""
    silent = []
    for path, text, tree in _modules():
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                imports = _imports_in(node)
                if imports and not _says_why(lines, imports[0]):
                    silent += [f"{_where(path, n)} {lines[n.lineno - 1].strip()}" for n in imports]
    assert not silent, sorted(set(silent))


# The package's layers, ground up: a module imports from its own layer and lower ones, never
# from a higher one (the bare ``protrain`` package is the API: ``wrap``'s layer).
LAYERS = (
    ("model", "knobs", "units", "devices"),
    ("chunks", "activations"),
    ("quant", "runtime"),
    ("optim", "distributed"),
    ("engine",),
    ("profile",),
    ("plan",),
    ("planned_wrap",),
    ("train",),
    ("cli", "integrations", "__main__"),
)
_LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
_LAYER_OF[""] = _LAYER_OF["planned_wrap"]


def _layer(module: str) -> int | None:
    """The layer of ``protrain.<top>...``, or None for a module outside the package."""
    parts = module.split(".")
    if parts[0] != "protrain":
        return None
    return _LAYER_OF[parts[1] if len(parts) > 1 else ""]


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules ``node`` imports; ``from protrain import x`` imports ``protrain.x`` where
    ``x`` is a top-level module of the package, else the package itself."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.module != "protrain":
        return [node.module or ""]
    return [f"protrain.{a.name}" if a.name in _LAYER_OF else "protrain" for a in node.names]


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for path, _, tree in _modules():
        rel = path.relative_to(SRC)
        if rel == Path("__init__.py"):
            continue
        own = _LAYER_OF[rel.parts[0].removesuffix(".py")]
        for node in _imports_in(tree):
            for module in _imported(node):
                layer = _layer(module)
                if layer is not None and layer > own:
                    upward.append(f"{_where(path, node)} imports {module}")
    assert not upward, upward
