"""Tasks: what one step computes (see expframe/tasks/base.py for the interface)."""

from expframe.tasks.base import Task
from expframe.tasks.classification import ClassificationTask
from expframe.tasks.d4pg import D4PGTask
from expframe.tasks.gan import GANTask
from expframe.tasks.keras_model import KerasModelTask

__all__ = ["Task", "ClassificationTask", "D4PGTask", "GANTask", "KerasModelTask"]
