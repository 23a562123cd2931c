"""Generate `stepstone/_sync_client.py`, the blocking `SyncClient`, and its `_sync_*` mixins from `Client`.

    python -m stepstone._gen_sync            # rewrite the module
    python -m stepstone._gen_sync --check    # exit 1 when the checked-in module is stale

Every public coroutine method of `Client` (the starts, then Client's own, then its other bases', each in
source order) becomes a method of `SyncClient` with the same signature and docstring; `Client.connect`'s
parameters become the constructor's. The starts and Client's own are written into `_sync_client.py`; each
other base's into a mixin module named like the base's (`client_tasks` -> `_sync_tasks`), so that the
blocking side is split as the async one is. The event loop thread they run on is `_sync_loop.SyncLoop`,
kept by hand. The module is checked in, so type checkers see every method;
`tests/test_sync_client.py` fails when it is stale.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from stepstone.client import Client
from stepstone.client_starts import StartOperations

__all__ = ["TARGET", "generate", "main"]

TARGET = Path(__file__).resolve().parent / "_sync_client.py"
_LINE = 120
_SKIP = {"connect", "close"}

# Names an annotation of Client may use, and where they come from: an unknown name stops the generator.
_IMPORTS = {
    "Any": "typing",
    "Sequence": "collections.abc",
    "datetime": "datetime",
    "timedelta": "datetime",
    "Workflow": "stepstone.authoring.workflow",
    "Registry": "stepstone.authoring.workflow",
    "Settings": "stepstone.config",
    "Limits": "stepstone.core.limits",
    "InstanceInfo": "stepstone.client",
    "Actor": "stepstone.core.attribution",
    "Operations": "stepstone.ops",
    "InstanceFilter": "stepstone.ops",
    "InstancePage": "stepstone.ops.model",
    "InstanceDetail": "stepstone.ops.model",
    "HistoryPage": "stepstone.ops.model",
    "BulkReport": "stepstone.ops.model",
    "ReplayResult": "stepstone.ops.model",
    "Callable": "collections.abc",
    "MigrationReport": "stepstone.ops.migration",
    "Cancellation": "stepstone.client",
    "Schedule": "stepstone.scheduling.schedule",
    "ScheduleInfo": "stepstone.scheduling.operations",
    "Schedules": "stepstone.scheduling.operations",
    "FlowLimits": "stepstone.scheduling.operations",
    "TaskInfo": "stepstone.client_tasks",
    "TaskPage": "stepstone.client_tasks",
    "TaskFilter": "stepstone.client_tasks",
    "SavedTaskFilter": "stepstone.client_tasks",
    "TaskCompletion": "stepstone.client_tasks",
    "BulkReassignment": "stepstone.client_tasks",
    "Published": "stepstone.client_messages",
    "SignalledOrStarted": "stepstone.client_messages",
}
_BUILTINS = {"str", "int", "float", "bool", "None", "list", "dict", "tuple", "set", "bytes", "object", "Client"}

_GENERATED = """\
# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""

_CLIENT_HEADER = _GENERATED + '''"""The blocking face of `Client`: the same methods, run on a private event loop thread.

The starts and `Client`'s own operations are here; those of its other bases are in the `_sync_*`
modules named like theirs, mixed in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop
{mixin_imports}from stepstone.client import Client

if TYPE_CHECKING:
{type_imports}

__all__ = ["SyncClient"]


class SyncClient({bases}):
    """`Client`'s operations as blocking calls; open it like `Client.connect`, close it (or use `with`)."""

{init}
        self._start_loop()
        try:
{init_call}
        except BaseException:
            self._stop_loop()
            raise
'''

_MIXIN_HEADER = _GENERATED + '''"""The blocking face of `{base}` (`{module}`), mixed into `SyncClient`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop

if TYPE_CHECKING:
{type_imports}

__all__ = ["{name}"]


class {name}(SyncLoop):
    """`{base}`'s operations as blocking calls."""
'''


def _default(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _parameters(sig: inspect.Signature) -> tuple[list[str], list[str]]:
    """(the parameter declarations after self, the arguments that pass them on)."""
    declared: list[str] = []
    passed: list[str] = []
    star = False
    for param in list(sig.parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise SystemExit(f"gen_sync: parameter {param} is not supported")
        if param.kind is param.KEYWORD_ONLY and not star:
            declared.append("*")
            star = True
        text = f"{param.name}: {param.annotation}" if param.annotation is not param.empty else param.name
        if param.default is not param.empty:
            text += f" = {_default(param.default)}"
        declared.append(text)
        passed.append(param.name if param.kind is param.POSITIONAL_OR_KEYWORD else f"{param.name}={param.name}")
    return declared, passed


def _def(name: str, declared: list[str], returns: str, *, noqa: dict[str, str]) -> str:
    one = f"    def {name}(self, {', '.join(declared)}) -> {returns}:"
    if len(one) <= _LINE and not noqa:
        return one
    lines = [f"    def {name}("]
    for item in ["self", *declared]:
        key = item.split(":")[0]
        lines.append(f"        {item},{noqa.get(key, '')}")
    lines.append(f"    ) -> {returns}:")
    return "\n".join(lines)


def _call(lead: str, function: str, passed: list[str], close: str, *, indent: int = 12) -> str:
    """`lead + function(args) + close` on one line, or with one argument a line when too long."""
    one = f"{lead}{function}({', '.join(passed)}){close}"
    if len(one) <= _LINE:
        return one
    pad = " " * indent
    return "\n".join([f"{lead}{function}(", *(f"{pad}{arg}," for arg in passed), f"{pad[:-4]}){close}"])


def _docstring(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "")
    if not text:
        return ""
    if '"""' in text or "\\" in text:
        raise SystemExit("gen_sync: a docstring with triple quotes or backslashes is not supported")
    body = "\n".join(f"        {line}" if line else "" for line in text.splitlines()).lstrip()
    return f'        """{body}"""\n'


def _names(annotations: list[str]) -> set[str]:
    found = set()
    for text in annotations:
        found |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    unknown = found - set(_IMPORTS) - _BUILTINS
    if unknown:
        raise SystemExit(f"gen_sync: add {sorted(unknown)} to _IMPORTS in stepstone/_gen_sync.py")
    return found & set(_IMPORTS)


def _noqa(sig: inspect.Signature) -> dict[str, str]:
    # A parameter named like a builtin (Client.start's `input`) carries Client's reason along.
    return {p: "  # noqa: A002 - the same name as Client's parameter" for p in sig.parameters if p in {"input", "id"}}


def generate() -> dict[Path, str]:
    """The text of `_sync_client.py` and of each mixin module, by path, for the `Client` imported now."""
    # The starts first (where an instance begins), then Client's own methods (steering it), then those of its
    # other bases in resolution order (schedules, tasks, messages); each class's in source order. Each name
    # stands for what Client resolves it to, and goes to the module of the class that defines that.
    names: dict[str, None] = {}
    for klass in (StartOperations, *Client.__mro__[:-1]):
        names.update(dict.fromkeys(vars(klass)))
    owners: dict[type, list[str]] = {}
    for name in names:
        member = inspect.getattr_static(Client, name)
        if name.startswith("_") or name in _SKIP or not inspect.iscoroutinefunction(member):
            continue
        owner = next(k for k in Client.__mro__ if name in vars(k))
        owners.setdefault(Client if owner in (Client, StartOperations) else owner, []).append(name)
    texts: dict[Path, str] = {}
    mixins: list[tuple[str, str]] = []  # (module, class) of each mixin, in resolution order
    for owner, members in owners.items():
        if owner is Client:
            continue
        module, name = _mixin(owner)
        annotations, methods = _methods(members)
        texts[TARGET.parent / f"{module}.py"] = _MIXIN_HEADER.format(
            base=owner.__name__, module=owner.__module__, name=name, type_imports=_type_imports(annotations),
        ) + "".join(f"\n{m}" for m in methods)
        mixins.append((module, name))
    annotations, methods = _methods(owners.get(Client, []))
    connect = inspect.signature(inspect.unwrap(Client.connect))
    declared, passed = _parameters(connect.replace(parameters=[
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *connect.parameters.values()
    ]))
    annotations += [str(p.annotation) for p in connect.parameters.values() if p.annotation is not p.empty]
    init = _def("__init__", declared, "None", noqa={})
    init += "\n" + _docstring(Client.connect.__doc__).rstrip("\n")
    init_call = _call("            self._client: Client = self._run(", "Client.connect", passed, ")", indent=16)
    texts[TARGET] = _CLIENT_HEADER.format(
        type_imports=_type_imports(annotations), init=init, init_call=init_call,
        mixin_imports="".join(f"from stepstone.{module} import {name}\n" for module, name in sorted(mixins)),
        bases=_bases([name for _, name in mixins] + ["SyncLoop"]),
    ) + "".join(f"\n{m}" for m in methods)
    return texts


def _bases(names: list[str]) -> str:
    one = ", ".join(names)
    if len(f"class SyncClient({one}):") <= _LINE:
        return one
    return "\n" + "".join(f"    {name},\n" for name in names)


def _mixin(owner: type) -> tuple[str, str]:
    """The module and class of the blocking face of one of Client's bases: client_tasks -> _sync_tasks."""
    return "_sync_" + owner.__module__.rsplit(".", 1)[-1].removeprefix("client_"), f"Sync{owner.__name__}"


def _methods(members: list[str]) -> tuple[list[str], list[str]]:
    """(the annotations they use, the text of each blocking method) for these names of Client's."""
    annotations: list[str] = []
    methods: list[str] = []
    for name in members:
        member = inspect.getattr_static(Client, name)
        sig = inspect.signature(member)
        declared, passed = _parameters(sig)
        annotations += [str(p.annotation) for p in sig.parameters.values() if p.annotation is not p.empty]
        annotations.append(str(sig.return_annotation))
        returns = str(sig.return_annotation)
        lead = "        return self._run(" if returns != "None" else "        self._run("
        body = _call(lead, f"self._client.{name}", passed, ")")
        methods.append(f"{_def(name, declared, returns, noqa=_noqa(sig))}\n{_docstring(member.__doc__)}{body}\n")
    return annotations, methods


def _type_imports(annotations: list[str]) -> str:
    modules: dict[str, list[str]] = {}
    for imported in sorted(_names(annotations) - {"Any"}):
        modules.setdefault(_IMPORTS[imported], []).append(imported)
    if "Any" in _names(annotations):
        modules.setdefault("typing", []).append("Any")
    lines = sorted((f"    from {module} import {', '.join(sorted(names))}" for module, names in modules.items()),
                   key=_import_order)
    first_party = next((n for n, line in enumerate(lines) if _import_order(line)[0]), len(lines))
    if 0 < first_party < len(lines):
        lines.insert(first_party, "")  # stdlib, then stepstone, as isort groups them
    return "\n".join(lines) or "    pass"


def _import_order(line: str) -> tuple[int, str]:
    module = line.split()[1]
    return (1 if module.startswith("stepstone") else 0, module)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    texts = generate()
    if args == ["--check"]:
        stale = [path for path, text in texts.items()
                 if not path.exists() or path.read_text(encoding="utf-8") != text]
        for path in stale:
            sys.stderr.write(f"{path} is stale: run `python -m stepstone._gen_sync`\n")
        return 1 if stale else 0
    if args:
        sys.stderr.write("usage: python -m stepstone._gen_sync [--check]\n")
        return 2
    for path, text in texts.items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
