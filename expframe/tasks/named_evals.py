"""Named evaluations of other data, as gin binds them on a task with a dataset function
(`ClassificationTask.evaluations`, `KerasModelTask.evaluations`):

    ClassificationTask.evaluations = {
        'eval_train': 'train',                          # another split of the task's dataset
        'eval_big': @big/shapes_input,                  # another dataset, on the task's eval split
        'eval_big_train': (@big/shapes_input, 'train'), # another dataset and split
    }

Each is evaluated beside the run's own evaluation (`eval`) with the same metrics, and
recorded under its name: `"split": "eval_train"` in metrics.jsonl, `eval_train/` in
TensorBoard (expframe/evaluator.py). A name is `eval_` and lower-case letters, digits or
underscores, so it never collides with the run's `train` and `eval` curves.
"""

import re
from typing import Any, Callable, Dict, Optional, Tuple

from expframe.errors import ConfigError

_NAME = re.compile(r"^eval_[a-z0-9_]+$")

Source = Tuple[Callable[..., Any], str]  # (dataset function, split)


def parse(binding: str, evaluations: Optional[Dict[str, Any]], dataset: Callable[..., Any],
          eval_split: Optional[str]) -> Dict[str, Source]:
    """{name: (dataset function, split)} from the binding's value; ConfigError naming the
    binding and the entry that is wrong.

    Args:
      binding: the binding's name, for messages (`ClassificationTask.evaluations`).
      evaluations: {name: split | dataset function | (dataset function, split)}, or None.
      dataset, eval_split: the task's own, for the entries that name only the other.
    """
    if not evaluations:
        return {}
    if not isinstance(evaluations, dict):
        raise ConfigError(f"{binding}={evaluations!r} must be a dict {{name: split or dataset}}, e.g. "
                          "{'eval_train': 'train'}.")
    parsed = {}
    for name, value in evaluations.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{binding} name {name!r}: a named evaluation is called eval_<name> (lower-case "
                              "letters, digits, underscores), e.g. 'eval_train'.")
        if isinstance(value, str):
            parsed[name] = (dataset, value)
        elif callable(value):
            if eval_split is None:
                raise ConfigError(f"{binding}[{name!r}] names a dataset but no split, and the task has no eval "
                                  f"split: bind ({value!r}, 'test') or the like.")
            parsed[name] = (value, eval_split)
        elif (isinstance(value, (tuple, list)) and len(value) == 2 and callable(value[0])
              and isinstance(value[1], str)):
            parsed[name] = (value[0], value[1])
        else:
            raise ConfigError(f"{binding}[{name!r}]={value!r}: bind a split ('train'), a dataset "
                              "(@my_dataset) or both (@my_dataset, 'test').")
    return parsed
