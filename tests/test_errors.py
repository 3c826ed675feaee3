"""One error hierarchy (issue 17): everything artcloud raises derives from `artcloud.ArtcloudError`, with a stable
`code`. Checked on the source itself, so a new `raise ValueError(...)` anywhere in the package fails here: every
`raise` statement is found in the AST of every module, its exception resolved against the imported module, and
it must be an ArtcloudError or one of the few exceptions below, each with its reason."""

from __future__ import annotations

import ast
import asyncio
import builtins
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest

import artcloud
from artcloud.errors import ArtcloudError

PACKAGE = Path(artcloud.__file__).parent

# (module file relative to the package, class name) -> why that raise is not an ArtcloudError.
NOT_ARTCLOUD = {
    ("__init__.py", "AttributeError"): "a module __getattr__ must raise AttributeError (Python's protocol: hasattr, "
                                       "from-imports and getattr defaults depend on it)",
    ("backends/providers.py", "NotImplementedError"): "the abstract methods of Provisioner, which each provider "
                                                      "overrides; reaching one is a bug in artcloud, not a user error",
    ("backends/client.py", "AssertionError"): "marks the end of a retry loop that always returns or raises (for "
                                              "the type checker); reaching it is a bug",
    ("backends/sky_api.py", "ClusterDoesNotExist"): "SkyAPI.logs keeps SkyPilot's own contract (sky.tail_logs raises "
                                                    "it for a missing cluster); sky.py catches it like SkyPilot's",
    ("types.py", "CancelledError"): "asyncio's cancellation, passed on so the caller's task is cancelled",
    ("cli/run.py", "Exit"): "typer.Exit sets the process's exit status; it is not an error",
    ("cli/cloud.py", "Exit"): "typer.Exit sets the process's exit status; it is not an error",
    ("server/preemption.py", "OSError"): "a metadata endpoint's HTTP failure, caught by the poller in the same "
                                         "module next to the OSErrors of the socket itself; it never leaves it",
    ("server/app.py", "RequestValidationError"): "FastAPI's own error for an invalid body, which the app answers "
                                                 "as 400 naming the field: the training route reads its body itself "
                                                 "(off the event loop) and reports it as FastAPI would",
    ("server/engines/sharded.py", "EOFError"): "the sharded trainer's control socket closed mid-message: "
                                               "ShardedTrainer._call in the same module turns it into an "
                                               "EngineError (the ranks stopped); in a rank, the server is gone",
    ("backends/forwarder.py", "RemoteProtocolError"): "h11's own error for a request that ends early, caught by "
                                                      "the connection handler in the same module (the connection "
                                                      "closes); it never leaves the forwarder's thread",
}
# Raised from any server module: FastAPI's mechanism for an HTTP answer (the app renders it as JSON with a
# `code`; a client sees an ArtcloudError built from that JSON, never this Python exception).
SERVER_HTTP_ERROR = "artcloud.server.api_errors.ApiError"

# (module file, the raised expression) that cannot be resolved statically: re-raises of an exception caught
# elsewhere, so its class was checked where it was first raised (or it is a user's, passed through).
RERAISES = {
    ("backends/modal.py", "item"): "an exception of the log-pump thread, raised again in the caller",
    ("backends/sandbox.py", "cause"): "KeyboardInterrupt / CancelledError, passed on untouched",
    ("storage/s3.py", "failed.exception"): "a worker's exception, raised again after the pool shut down",
    ("backends/local.py", "failed[0]"): "down()'s exception in the thread that ran it for `with LocalBackend()`, "
                                        "raised again in the caller",
}

# Two classes may share a code only when they mean the same thing to a caller.
SHARED_CODES: dict[str, str] = {}


def module_files() -> list[tuple[str, str]]:
    """(file relative to the package, module name) of every module, __main__ excluded (it runs the CLI)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        parts = ["artcloud", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found.append((rel, ".".join(parts)))
    return found


OPTIONAL = object()  # what a lazy import of an optional package resolves to where it is not installed


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Raises(ast.NodeVisitor):
    """Every `raise` of one module, with what encloses it (functions, classes, `except ... as NAME`)."""

    def __init__(self) -> None:
        self.stack: list[ast.AST] = []
        self.found: list[tuple[ast.Raise, list[ast.AST]]] = []

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.Raise):
            self.found.append((node, list(self.stack)))
        self.stack.append(node)
        super().generic_visit(node)
        self.stack.pop()


def resolve(target: ast.expr, enclosing: list[ast.AST], module: Any) -> Any:
    """The class (or function) `target` names, or None when only the running code knows it."""
    namespace = vars(module)
    if isinstance(target, ast.Name):
        for node in reversed(enclosing):
            if isinstance(node, ast.ExceptHandler) and node.name == target.id:
                return "reraise"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):  # a local factory: `def bad(...) -> CorruptCheckpoint`
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.name == target.id:
                        return returned(inner, namespace)
                    if isinstance(inner, ast.ImportFrom) and inner.level == 0:  # a lazy import
                        for alias in inner.names:
                            if (alias.asname or alias.name) == target.id:
                                return getattr(importlib.import_module(inner.module), alias.name)
                args = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                for arg in args:  # `error: type[ArtcloudError]`
                    if arg.arg == target.id:
                        return annotated_class(arg.annotation, namespace)
        if target.id in namespace:
            return namespace[target.id]
        return getattr(builtins, target.id, None)
    if isinstance(target, ast.Attribute):
        inner = target.value  # `self.provisioner.not_ready`: a method of the class the attribute is annotated with
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self":
            owner = next((n for n in reversed(enclosing) if isinstance(n, ast.ClassDef)), None)
            annotation = vars(namespace[owner.name]).get("__annotations__", {}).get(inner.attr) if owner else None
            if isinstance(annotation, str):
                return getattr(eval(annotation, namespace), target.attr, None)
            return None
        if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
            owner = next((n for n in reversed(enclosing) if isinstance(n, ast.ClassDef)), None)
            if owner is not None and owner.name in namespace:
                return getattr(namespace[owner.name], target.attr, None)
            return None
        root = target
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id not in namespace:  # `from sky import exceptions` in the function
            for node in reversed(enclosing):
                for inner in ast.walk(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
                    if isinstance(inner, ast.ImportFrom) and inner.level == 0:
                        for alias in inner.names:
                            if (alias.asname or alias.name) == root.id:
                                try:
                                    namespace = {root.id: importlib.import_module(f"{inner.module}.{alias.name}")}
                                except ImportError:  # an optional package (SkyPilot, Modal) not installed here
                                    return OPTIONAL
        try:
            return eval(ast.unparse(target), namespace)  # a dotted name: typer.Exit, exceptions.ClusterDoesNotExist
        except Exception:
            return None
    return None


def annotated_class(annotation: ast.expr | None, namespace: dict[str, Any]) -> Any:
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "type":
        return eval(ast.unparse(annotation.slice), namespace)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Callable":  # a factory passed in
        return eval(ast.unparse(annotation.slice.elts[-1]), namespace)  # `bad: Callable[[str], ArtcloudError]`
    return None  # an exception instance passed in: a re-raise


def returned(function: Any, namespace: dict[str, Any]) -> Any:
    """The class a factory function returns, from its return annotation."""
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        annotation = function.returns and ast.unparse(function.returns)
    else:
        annotation = inspect.signature(function).return_annotation
        namespace = function.__globals__
    assert isinstance(annotation, str) and annotation, f"{function} raises what it returns: annotate its return type"
    return eval(annotation, namespace)


def raised_classes() -> list[tuple[str, int, str, Any]]:
    """(file, line, the raised expression, the class it resolves to, "reraise", or None) for every raise."""
    found = []
    for rel, name in module_files():
        tree = ast.parse((PACKAGE / rel).read_text())
        visitor = Raises()
        visitor.visit(tree)
        if not visitor.found:
            continue
        assert not name.endswith("__main__"), f"{rel} raises: check it here (importing it runs the CLI)"
        module = importlib.import_module(name)
        for node, enclosing in visitor.found:
            if node.exc is None:
                found.append((rel, node.lineno, "raise", "reraise"))
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            value = resolve(target, enclosing, module)
            if callable(value) and not isinstance(value, type):
                value = returned(value, vars(module))
            found.append((rel, node.lineno, ast.unparse(target), value))
    return found


def test_every_raise_in_the_package_is_an_artcloud_error_or_a_justified_exception():
    wrong, used = [], set()
    found = raised_classes()
    resolved = {(rel, expression): value for rel, _, expression, value in found}
    # the resolver sees through factories, lazy imports and class attributes (else it would check nothing)
    from artcloud.server.api_errors import ApiError
    from artcloud.storage.checkpoints import CorruptCheckpoint

    assert resolved[("storage/checkpoints.py", "bad")] is CorruptCheckpoint
    assert resolved[("server/samples.py", "_bad")] is ApiError
    assert resolved[("backends/launch.py", "error")] is resolved[("backends/sandbox.py", "self.error")] is ArtcloudError
    assert resolved[("storage/s3.py", "vanished")] is artcloud.StorageError
    for rel, line, expression, value in found:
        where = f"artcloud/{rel}:{line}: raise {expression}"
        if value == "reraise":
            continue
        if value is OPTIONAL:  # the package is not installed here: the allowlist names the class it raises
            name = expression.rsplit(".", 1)[-1]
            if (rel, name) in NOT_ARTCLOUD:
                used.add((rel, name))
            else:
                wrong.append(f"{where}: raises a class of an optional package not installed here")
            continue
        if value is None:
            if (rel, expression) in RERAISES:
                used.add((rel, expression))
            else:
                wrong.append(f"{where}: cannot tell what it raises (raise a class, or a factory annotated with "
                             "its return type)")
            continue
        assert isinstance(value, type) and issubclass(value, BaseException), f"{where} is not an exception: {value}"
        if issubclass(value, ArtcloudError):
            continue
        if qualname(value) == SERVER_HTTP_ERROR and rel.startswith("server/"):
            continue
        if (rel, value.__name__) in NOT_ARTCLOUD:
            used.add((rel, value.__name__))
            continue
        wrong.append(f"{where}: {qualname(value)} is not an ArtcloudError (use artcloud.errors: InvalidArgument, "
                     "WrongType, WrongState, NotSupported, ... or a class deriving from ArtcloudError)")
    assert not wrong, "\n".join(wrong)
    stale = (set(NOT_ARTCLOUD) | set(RERAISES)) - used
    assert not stale, f"allowed exceptions nothing raises any more (remove them): {sorted(stale)}"


def exception_classes() -> list[type]:
    """Every exception class defined in the package."""
    classes = []
    for rel, name in module_files():
        tree = ast.parse((PACKAGE / rel).read_text())
        defined = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        if not defined:
            continue
        module = importlib.import_module(name)
        for cls_name in defined:
            cls = getattr(module, cls_name)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                classes.append(cls)
    return classes


def test_every_exception_class_derives_from_artcloud_error_with_its_own_code():
    classes = exception_classes()
    names = {cls.__name__ for cls in classes}
    # the classes the issue named are all found: the walk does not silently miss modules
    assert {"GatherError", "RulerError", "SkyError", "ModalError", "StorageError", "ClaimLost", "CorruptCheckpoint",
            "CorruptRemoteCheckpoint", "RunError", "CLIError", "ServeError", "NonFiniteError", "ModelNotFound",
            "SamplerUnavailable", "EngineArgsError", "Abandoned", "MissingDependency", "ApiError"} <= names
    codes: dict[str, list[str]] = {}
    for cls in classes:
        if qualname(cls) == SERVER_HTTP_ERROR:
            continue  # FastAPI's HTTPException: see SERVER_HTTP_ERROR
        assert issubclass(cls, ArtcloudError), f"{qualname(cls)} does not derive from artcloud.ArtcloudError"
        assert "code" in vars(cls) or cls is ArtcloudError, f"{qualname(cls)} has no `code` of its own"
        assert re.fullmatch(r"[a-z][a-z0-9_]*", cls.code), f"{qualname(cls)}.code {cls.code!r} is not snake_case"
        assert vars(cls).get("__doc__"), f"{qualname(cls)} has no docstring saying when it is raised"
        codes.setdefault(cls.code, []).append(qualname(cls))
    shared = {code: owners for code, owners in codes.items() if len(owners) > 1 and code not in SHARED_CODES}
    assert not shared, f"codes shared by several classes: {shared}"


def test_artcloud_exports_the_error_classes():
    import artcloud.errors

    for name, cls in vars(artcloud.errors).items():
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == "artcloud.errors":
            assert name in artcloud.__all__ and getattr(artcloud, name) is cls, name
    for name in ("GatherError", "RulerError", "SkyError", "ModalError", "ServerGone", "VersionMismatch",
                 "MissingDependency", "StorageError", "CorruptCheckpoint"):
        assert name in artcloud.__all__ and issubclass(getattr(artcloud, name), artcloud.ArtcloudError), name
    for name in artcloud.__all__:  # every exception artcloud exports is one of its own
        value = getattr(artcloud, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, artcloud.ArtcloudError), name


async def _ok() -> artcloud.Trajectory:
    return artcloud.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=1.0)


async def _boom() -> artcloud.Trajectory:
    raise KeyError("the user's own rollout bug")


def test_one_except_clause_catches_what_the_sdk_raises_and_the_codes_are_stable():
    caught, unrun = [], _ok()
    for call in (
        lambda: asyncio.run(artcloud.gather_trajectory_groups([artcloud.TrajectoryGroup([_ok(), _boom()])],
                                                              progress=False)),
        lambda: artcloud.RemoteBackend("http://localhost:1", token="t" * 20, ca_cert="x"),
        lambda: asyncio.run(artcloud.TrainableModel(name="m", project="p", base_model="b").train([])),
        lambda: artcloud.TrajectoryGroup([unrun]).to_wire(),
    ):
        try:
            call()
        except artcloud.ArtcloudError as e:
            caught.append(e)
    unrun.close()
    assert [(type(e).__name__, e.code) for e in caught] == [
        ("GatherError", "gather_failed"), ("InvalidArgument", "invalid_argument"),
        ("NotRegistered", "not_registered"), ("WrongState", "wrong_state"),
    ]
    # the builtin a plain-Python caller would catch still catches each
    assert isinstance(caught[1], ValueError) and isinstance(caught[2], RuntimeError)
    assert isinstance(caught[0].exceptions[0], KeyError)  # the user's own exception stays theirs
    assert "HTTPS only" in str(caught[1]) and "register" in str(caught[2])


def test_pydantic_wraps_an_artcloud_error_raised_in_a_validator():
    """A validator raising InvalidArgument (a ValueError) still gives pydantic's ValidationError, with the
    field's location: artcloud's models are pydantic models, and their construction errors stay pydantic's
    (ART's types are pydantic models too; its users catch ValidationError)."""
    with pytest.raises(pydantic.ValidationError) as info:
        artcloud.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=float("nan"))
    (error,) = info.value.errors()
    assert error["loc"] == ("reward",) and "finite" in error["msg"]
    assert isinstance(error["ctx"]["error"], artcloud.InvalidArgument)
