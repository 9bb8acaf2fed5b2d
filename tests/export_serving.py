"""Serving an export as a server would, for the export tests: in a fresh Python process that
never imports expframe, with TensorFlow alone (and Keras for `model.keras`)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow as tf

from expframe import export

ATOL = 1e-5

# For each (export_dir, inputs.npz, outputs.npz): loads the SavedModel, calls each signature
# that has inputs (named "signature/argument"), reads each asset through the loaded object
# ("assets/name"), and where the inputs hold "keras/input", calls model.keras on it
# ("keras/output"); writes them to outputs.npz. Strings come back as bytes arrays.
LOADER = textwrap.dedent("""
    import json
    import os
    import sys
    import numpy as np
    import tensorflow as tf
    for export_dir, inputs, outputs in json.loads(sys.argv[1]):
        loaded = tf.saved_model.load(export_dir)
        feeds, got = np.load(inputs), {}
        for name, fn in loaded.signatures.items():
            args = {k.split("/", 1)[1]: tf.constant(feeds[k]) for k in feeds.files if k.startswith(name + "/")}
            if not args:
                continue
            for key, value in fn(**args).items():
                value = value.numpy()
                got[f"{name}/{key}"] = value.astype(bytes) if value.dtype == object else value
        for name, asset in getattr(loaded, "assets", {}).items():
            got[f"assets/{name}"] = np.array(tf.io.read_file(asset.asset_path).numpy())
        if "keras/input" in feeds.files:
            import keras
            model = keras.models.load_model(os.path.join(export_dir, "model.keras"))
            got["keras/output"] = np.asarray(model(feeds["keras/input"], training=False))
        np.savez(outputs, **got)
    assert "expframe" not in sys.modules, sorted(m for m in sys.modules if m.startswith("expframe"))
""")


def serve_many(exports, tmp_path):
    """[{"signature/output": value, ...}] of each (export_dir, inputs) in `exports`, all served
    in one fresh process (one TensorFlow start for them all)."""
    jobs = []
    for i, (export_dir, inputs) in enumerate(exports):
        np.savez(tmp_path / f"inputs_{i}.npz", **inputs)
        jobs.append((str(export_dir), str(tmp_path / f"inputs_{i}.npz"), str(tmp_path / f"outputs_{i}.npz")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOADER, json.dumps(jobs)], cwd=tmp_path,
                          env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = []
    for _, _, outputs in jobs:
        with np.load(outputs) as got:
            out.append({k: got[k] for k in got.files})
    return out


def serve_elsewhere(export_dir, inputs, tmp_path):
    """{"signature/output": value} from the SavedModel loaded in a fresh process, called on `inputs`."""
    return serve_many([(export_dir, inputs)], tmp_path)[0]


def compare(got, expected, atol=ATOL):
    """Asserts each expected value (dtype, shape, and within atol; strings equal); returns
    the largest absolute difference of the numbers."""
    worst = 0.0
    for key, want in expected.items():
        want = np.asarray(want)
        assert key in got, (key, sorted(got))
        assert got[key].shape == want.shape, (key, got[key].shape, want.shape)
        if want.dtype.kind in "SUO":
            np.testing.assert_array_equal(got[key].astype(bytes), want.astype(bytes), err_msg=key)
            continue
        assert got[key].dtype == want.dtype, (key, got[key].dtype, want.dtype)
        np.testing.assert_allclose(got[key], want, atol=atol, rtol=0, err_msg=key)
        worst = max(worst, float(np.abs(got[key].astype(np.float64) - want).max(initial=0.0)))
    return worst


def assert_served(task, inputs, expected, tmp_path):
    """Exports `task`, serves `inputs` elsewhere, compares with `expected` ("signature/output":
    value, or a function giving them after the export); returns the largest absolute difference."""
    info = export.export_saved_model(task, str(tmp_path / "export"))
    expected = expected() if callable(expected) else expected
    assert info["export_dir"] == str(tmp_path / "export")
    assert set(info["signatures"]) == {k.split("/")[0] for k in expected}
    assert all(sorted(k.split("/")[1] for k in expected if k.startswith(name + "/")) == signature["outputs"]
               for name, signature in info["signatures"].items())
    got = serve_elsewhere(tmp_path / "export", inputs, tmp_path)
    assert sorted(k for k in got if k.split("/")[0] in info["signatures"]) == sorted(expected)
    worst = compare(got, expected)
    print(f"max abs difference {worst:.3g}")
    return worst


def classifier_outputs(logits, prefix="serving_default/", class_names=None, rows=None):
    """The outputs `image_serving.class_outputs` gives for `logits` (rows of them), as served."""
    logits = np.asarray(logits, np.float32)[slice(None) if rows is None else rows]
    probabilities = tf.nn.softmax(logits).numpy()
    k = min(5, logits.shape[-1])
    order = np.argsort(-probabilities, axis=-1, kind="stable")[:, :k].astype(np.int32)
    out = {prefix + "logits": logits, prefix + "probabilities": probabilities, prefix + "top_k_classes": order,
           prefix + "top_k_probabilities": np.take_along_axis(probabilities, order, -1)}
    if class_names is not None:
        out[prefix + "top_k_class_names"] = np.array(class_names, dtype=bytes)[order]
    return out
