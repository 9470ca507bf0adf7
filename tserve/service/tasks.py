"""The tasks a server serves: `ServedModel` subclasses by the checkpoint task they serve (one package per model
kind: `service.generation`, `service.translation`, `service.vision`); the registry builds the right one for each
loaded model. `--task-modules` imports more modules, each of which calls `register` for
the tasks it adds."""

from __future__ import annotations

import importlib

from tserve.service.generation.served import ServedLanguageModel
from tserve.service.served import AttentionResult, ServedModel
from tserve.service.translation.served import ServedTranslator
from tserve.service.vision.served import ServedClassifier

SERVED: dict[str, type[ServedModel]] = {}


def register(cls: type[ServedModel]) -> type[ServedModel]:
    """Serve checkpoints of `cls.task` with `cls` (usable as a class decorator)."""
    SERVED[cls.task] = cls
    return cls


for _cls in (ServedLanguageModel, ServedTranslator, ServedClassifier):
    register(_cls)


def import_task_modules(modules: list[str]) -> None:
    """Import each module (dotted path) so that it registers its tasks."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise RuntimeError(f"task module {name!r} cannot be imported: {exc}") from exc


def served_class(task: str) -> type[ServedModel]:
    if task not in SERVED:
        raise RuntimeError(f"no task module serves {task!r} (tasks: {sorted(SERVED)}); add one with "
                           "--task-modules")
    return SERVED[task]


__all__ = ["SERVED", "AttentionResult", "ServedClassifier", "ServedLanguageModel", "ServedModel",
           "ServedTranslator", "import_task_modules", "register", "served_class"]
