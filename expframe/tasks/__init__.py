"""Tasks: what one step computes (see expframe/tasks/base.py for the interface)."""

from expframe.tasks.base import Task
from expframe.tasks.classification import ClassificationTask

__all__ = ["Task", "ClassificationTask"]
