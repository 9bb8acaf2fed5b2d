"""A stand-in for main.py in runner tests: same flags, same run files, no TensorFlow.

It reads `--gin_param`s and `--model_dir`, writes config.gin, parsed_config.gin, metrics.jsonl and
result.json like a run of `Trainer.train_steps` steps, and records its environment
(env.json) and how many times it started (starts.txt). Its "parsed" config is its
bindings, one a line (`parsed_config(bindings)`); like main.py it refuses (exit 2,
writing nothing) a model_dir whose parsed_config.gin differs, unless
--allow_config_change. A learning rate of 1e30 fails like a NaN loss (exit 1,
`error: ...` on stderr); `fake.sleep_s = S` sleeps first (to test signals);
`fake.kill_self = True` dies of SIGKILL; `fake.no_result = True` exits 0 without
writing result.json.
"""

import json
import os
import signal
import sys
import time


def parsed_config(params):
    """The fake's parsed_config.gin for these bindings."""
    return "\n".join(params) + "\n"


def main(argv):
    params = [a.split("=", 1)[1] for a in argv if a.startswith("--gin_param=")]
    model_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--model_dir="))
    bindings = dict(p.split(" = ", 1) for p in params)
    try:
        with open(os.path.join(model_dir, "parsed_config.gin")) as f:
            previous = f.read()
    except OSError:
        previous = None
    if previous not in (None, parsed_config(params)) and "--allow_config_change" not in argv:
        print(f"error: {model_dir}/parsed_config.gin differs from this run's config; resume with the same "
              "configuration, pass --allow_config_change, or use a new --model_dir.", file=sys.stderr)
        return 2
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "starts.txt"), "a") as f:
        f.write(f"{time.time()}\n")
    with open(os.path.join(model_dir, "env.json"), "w") as f:
        json.dump({"TF_NUM_INTRAOP_THREADS": os.environ.get("TF_NUM_INTRAOP_THREADS")}, f)
    for name in ("config.gin", "parsed_config.gin"):  # the fake's "parsed" config: its bindings
        with open(os.path.join(model_dir, name), "w") as f:
            f.write(parsed_config(params))
    time.sleep(float(bindings.get("fake.sleep_s", 0)))
    if bindings.get("fake.kill_self") == "True":  # e.g. the kernel's OOM killer
        os.kill(os.getpid(), signal.SIGKILL)
    steps = int(bindings.get("Trainer.train_steps", 2))
    batch = int(bindings.get("Trainer.global_batch_size", 8))
    with open(os.path.join(model_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 1, "split": "train", "loss": 2.0, "examples_per_sec": 10.0 * batch}) + "\n")
        if float(bindings.get("keras.optimizers.Adam.learning_rate", 0)) >= 1e30:
            print("step 1/2  loss 2.0", flush=True)
            print("error: loss is nan at step 2; stopped.", file=sys.stderr, flush=True)
            return 1
        f.write(json.dumps({"step": steps, "split": "train", "loss": 1.0, "examples_per_sec": 20.0 * batch}) + "\n")
        f.write(json.dumps({"step": steps, "split": "eval", "top1": batch / 100.0, "loss": 1.5}) + "\n")
    if bindings.get("fake.no_result") == "True":  # e.g. a program that swallowed its error
        return 0
    with open(os.path.join(model_dir, "result.json"), "w") as f:
        json.dump({"step": steps, "target": "cpu", "num_replicas": 2, "global_batch_size": batch,
                   "eval": {"top1": batch / 100.0, "loss": 1.5}, "wall_time_s": 0.5}, f)
    print(f"step {steps}/{steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
