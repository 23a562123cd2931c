"""Keeping sensitive values out of everything but the live state.

A workflow names sensitive paths in its state (key paths; `*` stands for any list item) and may
give a hook that rewrites any text bound for history or an error. `Redaction.decision` rewrites a
decision before it is committed: the state copies and patches in its history entries have the
values at those paths replaced by `REDACTED`, and every text (error messages, reasons) has each
sensitive value the state holds, before or after the step, replaced too; the hook runs last on
every text. The new state itself is left alone: the next handler needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from stepstone.core.effects import (
    AdvanceSaga,
    Effect,
    EmitEvent,
    IfStopped,
    MovePosition,
    NotifyParent,
    OpenTask,
    RecordHistory,
    RedactClaimedPayload,
    SetState,
)
from stepstone.core.model import CommandView, Decision, Settle
from stepstone.core.saga import COMPENSATION_FAILED_EVENT

__all__ = ["MIN_SCRUBBED", "REDACTED", "Hook", "Path", "PayloadKey", "Redaction", "redact_state"]

REDACTED = "[redacted]"
MIN_SCRUBBED = 4
"""Sensitive values shorter than this are redacted at their paths but not searched for in free text."""

Path = tuple[str, ...]
Hook = Callable[[str], str]
PayloadKey = tuple[str, ...]


def _redact_at(doc: Any, path: Path) -> Any:
    if not path or doc is None:
        return doc
    head, rest = path[0], path[1:]
    if head == "*":
        if not isinstance(doc, list):
            return doc
        return [(REDACTED if item is not None else None) if not rest else _redact_at(item, rest) for item in doc]
    if not isinstance(doc, dict) or head not in doc or doc[head] is None:
        return doc
    return {**doc, head: REDACTED if not rest else _redact_at(doc[head], rest)}


def redact_state(doc: Any, paths: Iterable[Path]) -> Any:
    """`doc` with the value at every path replaced by `REDACTED` (a copy where anything changed)."""
    for path in paths:
        doc = _redact_at(doc, path)
    return doc


def _values_at(doc: Any, path: Path, out: set[str]) -> None:
    if doc is None:
        return
    if not path:
        if isinstance(doc, (str, int, float)) and not isinstance(doc, bool):
            text = str(doc)
            if len(text) >= MIN_SCRUBBED and text != REDACTED:
                out.add(text)
        elif isinstance(doc, (dict, list)):
            for leaf in (doc.values() if isinstance(doc, dict) else doc):
                _values_at(leaf, (), out)
        return
    head, rest = path[0], path[1:]
    if head == "*" and isinstance(doc, list):
        for item in doc:
            _values_at(item, rest, out)
    elif isinstance(doc, dict) and head in doc:
        _values_at(doc[head], rest, out)


def _pointer_parts(pointer: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]


def _pointer(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _matches(prefix: list[str], path: Path) -> bool:
    """Whether the concrete `prefix` (pointer parts) lies along `path` (`*` matches any list index)."""
    if len(prefix) > len(path):
        return False
    return all(p == s or (s == "*" and p.isdigit()) for p, s in zip(prefix, path, strict=False))


@dataclass(frozen=True)
class Redaction:
    """Sensitive paths of a state and an optional hook on text; empty means nothing to do."""

    paths: tuple[Path, ...] = ()
    hook: Hook | None = None
    payloads: tuple[tuple[PayloadKey, tuple[Path, ...]], ...] = ()
    """(whose payload, its sensitive paths) from the payload models: ("signal", name) for a signal or
    message of that name, ("task", step, decision) for a task decision."""

    @property
    def empty(self) -> bool:
        return not self.paths and self.hook is None and not self.payloads

    def payload_paths(self, key: PayloadKey) -> tuple[Path, ...]:
        """The sensitive paths of the payload `key` names; a key of two parts ("task", decision) matches
        that decision of every task (a step's cause names the decision, not the task step)."""
        found: list[Path] = []
        for k, paths in self.payloads:
            if k == key or (len(key) == 2 and key[0] == "task" and k[0] == "task" and k[2:] == key[1:]):
                found.extend(paths)
        return tuple(dict.fromkeys(found))

    def with_payload(self, key: PayloadKey, paths: tuple[Path, ...]) -> Redaction:
        """This redaction with `paths` sensitive in the payload `key` names too."""
        merged = tuple(dict.fromkeys((*self.payload_paths(key), *paths)))
        others = tuple((k, p) for k, p in self.payloads if k != key)
        return replace(self, payloads=(*others, (key, merged)) if merged else others)

    def _payload_parts(self, command: CommandView) -> list[tuple[Path, tuple[Path, ...]]]:
        """Where in the claimed command's payload a signal's, message's or task decision's payload sits,
        with its sensitive paths."""
        return self._parts_of(command.kind, command.name, command.step, command.payload)

    def _parts_of(self, kind: str, name: Any, step: Any, payload: Any) -> list[tuple[Path, tuple[Path, ...]]]:
        payload = payload if isinstance(payload, dict) else {}
        if kind == "SIGNAL":
            return [((), self.payload_paths(("signal", str(name))))]
        if kind == "MESSAGE":
            return [(("payload",), self.payload_paths(("signal", str(name))))]
        if kind == "TASK_COMPLETION":
            return [(("payload",), self.payload_paths(("task", str(step), str(name))))]
        parts: list[tuple[Path, tuple[Path, ...]]] = []
        if isinstance(signal := payload.get("signal"), dict):
            parts.append((("signal", "payload"), self.payload_paths(("signal", str(signal.get("name"))))))
        if isinstance(task := payload.get("task"), dict):
            parts.append((("task", "payload"), self.payload_paths(("task", str(task.get("decision"))))))
        return parts

    def _payload(self, command: CommandView | None) -> tuple[Any, frozenset[str]]:
        """The claimed command's payload with the sensitive values of what it carries replaced, and those values."""
        if command is None or not self.payloads or command.payload is None:
            return command.payload if command is not None else None, frozenset()
        payload, found = command.payload, set[str]()
        for where, paths in self._payload_parts(command):
            full = tuple((*where, *path) for path in paths)
            for path in full:
                _values_at(payload, path, found)
            payload = redact_state(payload, full)
        return payload, frozenset(found)

    # -- the registration document, and what the operator's views show --------------------------

    def document_fields(self) -> dict[str, Any]:
        """What a registration document keeps of this redaction (the hook is code: only the worker has
        it): `sensitive`, the state's paths the database redacts by, and `sensitive_payloads`, those of
        each payload model, which the views of open commands and tasks redact by."""
        fields: dict[str, Any] = {}
        if self.paths:
            fields["sensitive"] = [list(p) for p in self.paths]
        if any(paths for _, paths in self.payloads):
            fields["sensitive_payloads"] = [{"of": list(key), "paths": [list(p) for p in paths]}
                                            for key, paths in self.payloads if paths]
        return fields

    @classmethod
    def of_document(cls, sensitive: Any, sensitive_payloads: Any = None) -> Redaction:
        """The redaction a registration document stores (its `sensitive` and `sensitive_payloads`)."""
        def paths_of(value: Any) -> tuple[Path, ...]:
            return tuple(tuple(str(p) for p in path) for path in value or () if isinstance(path, list))

        payloads = tuple((tuple(str(k) for k in item["of"]), paths_of(item.get("paths")))
                         for item in sensitive_payloads or () if isinstance(item, dict)
                         and isinstance(item.get("of"), list))
        return cls(paths_of(sensitive), None, payloads)

    def shown_state(self, state: Any) -> Any:
        return redact_state(state, self.paths)

    def shown_command(self, row: dict[str, Any]) -> dict[str, Any]:
        """A command row (kind, name, step, payload) with the payload it carries redacted, open or not."""
        if not self.payloads or row.get("payload") is None:
            return row
        payload = row["payload"]
        for where, paths in self._parts_of(str(row.get("kind")), row.get("name"), row.get("step"), payload):
            payload = redact_state(payload, tuple((*where, *path) for path in paths))
        return {**row, "payload": payload}

    def shown_history(self, row: dict[str, Any]) -> dict[str, Any]:
        """A history row with its data's state copies and patches redacted at the paths (the worker stored
        them so already; this holds for any entry written another way too)."""
        return {**row, "data": self.history_data(row.get("data"))} if self.paths else row

    def shown_task(self, task: dict[str, Any]) -> dict[str, Any]:
        """A task as its views show it: the state fields it shows redacted at the state's paths, its
        completion's payload at the decision's."""
        data, completion = task.get("data"), task.get("completion")
        if isinstance(data, dict) and self.paths:
            shown = self.patch([{"op": "add", "path": "/" + "/".join(_pointer(p) for p in field.split(".")),
                                 "value": value} for field, value in data.items()])
            data = {field: op["value"] for field, op in zip(data, shown, strict=True)}
        if isinstance(completion, dict) and completion.get("payload") is not None:
            paths = self.payload_paths(("task", str(task.get("step")), str(completion.get("decision"))))
            completion = {**completion, "payload": redact_state(completion["payload"], paths)}
        return {**task, "data": data, "completion": completion}

    def shown_waits(self, state: Any, waiting_for: Any, positions: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
        """What an instance waits for and its positions as the views show them: a wait's correlation key read
        from a sensitive field of the live `state` (`correlation="email"`) redacted, as the state beside it is
        (the key is that field's value, as text: compared with the sensitive values the worker scrubs)."""
        secrets = self.secrets(state) if self.paths else frozenset()

        def shown(wait: Any) -> Any:
            key = wait.get("correlation_key") if isinstance(wait, dict) else None
            return {**wait, "correlation_key": REDACTED} if key is not None and str(key) in secrets else wait

        return shown(waiting_for), [{**p, "wait": shown(p.get("wait"))} if "wait" in p else p for p in positions]

    def secrets(self, *states: Any) -> frozenset[str]:
        """The sensitive values the states hold, as text, for scrubbing free text."""
        found: set[str] = set()
        for state in states:
            for path in self.paths:
                _values_at(state, path, found)
        return frozenset(found)

    def text(self, value: str, secrets: Iterable[str] = ()) -> str:
        for secret in sorted(secrets, key=len, reverse=True):
            value = value.replace(secret, REDACTED)
        return self.hook(value) if self.hook is not None else value

    def scrub(self, value: Any, secrets: Iterable[str] = ()) -> Any:
        """Every text inside `value` (keys left alone) through `text`."""
        secrets = tuple(secrets)
        if isinstance(value, str):
            return self.text(value, secrets)
        if isinstance(value, dict):
            return {k: self.scrub(v, secrets) for k, v in value.items()}
        if isinstance(value, list):
            return [self.scrub(v, secrets) for v in value]
        return value

    def patch(self, ops: list[Any]) -> list[Any]:
        """An RFC 6902 patch with the values it writes at sensitive paths redacted."""
        out = []
        for op in ops:
            if not isinstance(op, dict) or "value" not in op or not isinstance(op.get("path"), str):
                out.append(op)
                continue
            parts = _pointer_parts(op["path"])
            value = op["value"]
            for path in self.paths:
                if _matches(parts, path):
                    rest = path[len(parts):]
                    value = (REDACTED if value is not None else None) if not rest else _redact_at(value, rest)
                elif len(parts) > len(path) and _matches(parts[: len(path)], path):
                    value = REDACTED  # inside a sensitive value
            out.append({**op, "value": value})
        return out

    def history_data(self, data: Any, secrets: Iterable[str] = ()) -> Any:
        """A history entry's data: state copies and patches redacted at the paths, texts scrubbed."""
        if isinstance(data, dict):
            if "state" in data:
                data = {**data, "state": redact_state(data["state"], self.paths)}
            if isinstance(data.get("patch"), list):
                data = {**data, "patch": self.patch(data["patch"])}
        return self.scrub(data, secrets)

    def failure_text(self, text: str, before: Any, command: CommandView | None = None) -> str:
        """A failed handler's message as `decision` stores it (a failed step sets no state): for what
        leaves the worker beside the history, the trace span's status."""
        if self.empty:
            return text
        return self.text(text, self.secrets(before) | self._payload(command)[1])

    def decision(self, decision: Decision, before: Any, command: CommandView | None = None) -> Decision:
        """The decision as it may be stored: history, errors, the report to a parent and the claimed
        command's payload redacted; the live state (and a payload that runs again) untouched."""
        if self.empty:
            return decision
        new_state = decision.first(SetState)
        payload, in_payload = self._payload(command)
        secrets = self.secrets(before, None if new_state is None else new_state.state) | in_payload
        effects = [self._effect(effect, secrets) for effect in decision.effects]
        settle = decision.settle
        if command is not None and payload != command.payload and settle.state not in _RUNS_AGAIN:
            task = payload.get("task_id") if command.kind == "TASK_COMPLETION" and isinstance(payload, dict) else None
            effects.append(RedactClaimedPayload(payload, None if task is None else str(task),
                                                None if task is None else payload.get("payload")))
        if settle.reason is not None:
            settle = Settle(settle.state, self.text(settle.reason, secrets), settle.retry_delay)
        return Decision(settle, tuple(effects))

    def _effect(self, effect: Effect, secrets: frozenset[str]) -> Effect:  # noqa: PLR0911 - one return per kind
        if isinstance(effect, RecordHistory):
            return replace(effect, data=self.history_data(effect.data, secrets))
        if isinstance(effect, (MovePosition, AdvanceSaga)) and effect.error is not None:
            # a position's error; a compensation's last error (its record, its instance's error)
            return replace(effect, error=self.scrub(effect.error, secrets))
        if isinstance(effect, EmitEvent) and effect.type == COMPENSATION_FAILED_EVENT:
            # the engine's alert, which quotes that last error (an event a handler emits is its own data)
            return replace(effect, payload=self.scrub(effect.payload, secrets))
        if isinstance(effect, NotifyParent):
            return replace(effect, payload=self._report(effect.payload, secrets))
        if isinstance(effect, OpenTask) and isinstance(effect.task, dict):
            # The title and the description fill `{field}` from the state: texts every view of the task shows.
            return replace(effect, task={**effect.task, **{k: self.text(effect.task[k], secrets)
                                                           for k in ("title", "description")
                                                           if isinstance(effect.task.get(k), str)}})
        if isinstance(effect, IfStopped):
            return IfStopped(tuple(self._effect(e, secrets) for e in effect.stopped),
                             tuple(self._effect(e, secrets) for e in effect.passed))
        return effect

    def _report(self, payload: Any, secrets: Iterable[str]) -> Any:
        """A child's report to its parent: its final state redacted at this workflow's paths, texts scrubbed."""
        if not isinstance(payload, dict):
            return payload
        if "state" in payload:
            payload = {**payload, "state": redact_state(payload["state"], self.paths)}
        if payload.get("error") is not None:
            payload = {**payload, "error": self.scrub(payload["error"], secrets)}
        return payload


_RUNS_AGAIN = frozenset({"RETRY", "PARKED", "DEAD"})
"""Settlements after which the claimed command runs again (so its payload is kept whole)."""
