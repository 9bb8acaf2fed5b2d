"""What the planner measures (expframe/plan/measure.py): FLOPs of traced graphs against
hand counts, activation bytes kept for the backward pass, parameter and slot bytes of a
built model and optimizer. Tiny models, in-process."""

import keras
import pytest
import tensorflow as tf

from expframe.plan import measure


def _graph(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph


def test_dense_layer_flops_are_2bkm():
    b, k, m = 4, 32, 16
    graph = _graph(lambda x, w: tf.matmul(x, w), tf.TensorSpec((b, k)), tf.TensorSpec((k, m)))
    assert measure.graph_flops(graph) == 2 * b * k * m


def test_convolution_flops_are_2_x_outputs_x_kernel_volume_x_input_channels():
    b, h, w, cin, cout, kh, kw = 2, 8, 8, 3, 5, 3, 3
    graph = _graph(lambda x, f: tf.nn.conv2d(x, f, strides=1, padding="SAME"),
                   tf.TensorSpec((b, h, w, cin)), tf.TensorSpec((kh, kw, cin, cout)))
    assert measure.graph_flops(graph) == 2 * (b * h * w * cout) * (kh * kw * cin)
    strided = _graph(lambda x, f: tf.nn.conv2d(x, f, strides=2, padding="VALID"),
                     tf.TensorSpec((b, h, w, cin)), tf.TensorSpec((kh, kw, cin, cout)))
    assert measure.graph_flops(strided) == 2 * (b * 3 * 3 * cout) * (kh * kw * cin)  # (8 - 3) // 2 + 1 = 3


def test_a_training_step_of_a_dense_layer_is_three_matmuls():
    # Forward x @ w, backward dL/dw = x^T g and dL/dx = g w^T: 3 x 2bkm, plus the loss's few element-wise ops.
    b, k, m = 8, 64, 32

    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            loss = tf.reduce_sum(tf.matmul(x, w))
        return tape.gradient(loss, [x, w])

    flops = measure.graph_flops(_graph(step, tf.TensorSpec((b, k)), tf.TensorSpec((k, m))))
    assert 6 * b * k * m <= flops <= 6 * b * k * m + 2 * b * m


def test_saved_activations_are_the_forward_tensors_backward_reads():
    # h = relu(x @ w1); loss = sum(h @ w2). Backward reads x (for dw1), relu's output h (relu's own
    # gradient and dw2); the variables' reads are parameters, not activations.
    b, k, m = 4, 6, 5
    w1, w2 = tf.Variable(tf.ones((k, m))), tf.Variable(tf.ones((m, 1)))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2))
        return tape.gradient(loss, [w1, w2])

    graph = _graph(step, tf.TensorSpec((b, k)))
    assert measure.saved_activation_bytes(graph) == 4 * (b * k + b * m)


def test_parameter_gradient_and_slot_bytes_of_a_model_and_adam():
    k, m = 10, 3
    model = keras.Sequential([keras.Input((k,)), keras.layers.Dense(m), keras.layers.BatchNormalization()])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    sizes = measure.variable_bytes({"model": model, "optimizer": optimizer})
    trainable = (k * m + m) + 2 * m          # dense kernel and bias, BN gamma and beta
    assert sizes["grads"] == 4 * trainable
    assert sizes["params"] == 4 * (trainable + 2 * m)  # + BN moving mean and variance
    assert sizes["num_params"] == trainable + 2 * m
    # Adam: two moments per trainable weight, plus its step counter and learning rate (a few bytes).
    assert 2 * 4 * trainable <= sizes["slots"] <= 2 * 4 * trainable + 16


def test_memory_info_where_the_device_reports_it():
    try:
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except (ValueError, tf.errors.OpError):
        pytest.skip("this TensorFlow does not report CPU memory (the traced sizes above are the check)")
    tensor = tf.ones((256, 1024))  # 1 MiB
    assert tf.config.experimental.get_memory_info("CPU:0")["current"] - before >= tensor.shape.num_elements() * 4


def resnet50_saved_elements_per_image(size: int = 224, classes: int = 1000) -> int:
    """A framework-independent count of the tensors ResNet-50 v1.5 keeps for its backward
    pass, per image, each tensor once: every convolution's input and every batch norm's
    input (the convolution's output), every ReLU's output (its gradient reads it; it is also
    the next convolution's input), max pooling's input and output, the pooled features (the
    dense layer's input) and the loss's softmax gradient and smoothed labels. A residual
    add and global average pooling keep nothing of their own."""
    def hw(s):
        return s * s
    total = hw(size) * 3                          # the image: the stem convolution's input
    s = size // 2
    total += 2 * hw(s) * 64                       # stem conv output (BN input) and its ReLU output
    s //= 2
    total += hw(s) * 64                           # max pool output (its input is the stem ReLU's, counted)
    width_in = 64
    for stage, (blocks, mid) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        out = 4 * mid
        for block in range(blocks):
            stride = 2 if (block == 0 and stage > 0) else 1   # v1.5: the stride is on the 3x3 conv
            s_in, s_out = s, s // stride
            total += 2 * hw(s_in) * mid           # conv1 output + ReLU output (1x1, no stride)
            total += 2 * hw(s_out) * mid          # conv2 output + ReLU output (3x3, the stride)
            total += hw(s_out) * out              # conv3 output (BN input)
            if block == 0:
                total += hw(s_out) * out          # the projection shortcut's conv output (BN input)
            total += hw(s_out) * out              # the block's ReLU output (the next block's input)
            s, width_in = s_out, out
    total += width_in                             # pooled 2048 features, the dense layer's input
    total += 2 * classes                          # softmax cross-entropy's gradient and the smoothed labels
    return total


def test_resnet50_activations_are_the_per_layer_sum_of_its_saved_tensors():
    """The measured footprint of experiments/resnet50_imagenet_gpu.gin against the count above
    (84.3 MB per image in float32), and anchors.json's stored copy of it against the measurement."""
    from expframe.plan import anchors  # pylint: disable=import-outside-toplevel
    files = ["experiments/resnet50_imagenet_gpu.gin"]
    settings = measure.experiment_settings(files, [])
    fp, _ = measure.footprint(files, [], settings)
    reference = 4 * resnet50_saved_elements_per_image()
    assert reference == pytest.approx(84.31e6, rel=1e-3)
    assert fp.activation_bytes_per_example == reference
    assert fp.activation_bytes_fixed < 1e6  # batch-norm moments and the like, no parameter-sized tensors
    assert fp.sync_collectives == 53 and fp.all_reduce_bytes == [fp.grad_bytes]
    stored = anchors.load()["footprint"]
    for key in ("flops_per_example", "activation_bytes_per_example", "param_bytes", "grad_bytes", "slot_bytes", "ops",
                "compiled_kernels", "sync_collectives"):
        assert getattr(fp, key) == pytest.approx(stored[key], rel=1e-3), key
    assert [list(c) for c in fp.sync_bn] == stored["sync_bn"]


def test_saved_activations_leave_out_the_backward_passs_own_sums():
    """TensorFlow names some gradient sums AddN_k outside gradient_tape/: they are backward
    tensors, not activations (ResNet-50 counted 151 MB per image with them, 84 MB without)."""
    b, k = 4, 6
    w = tf.Variable(tf.ones((k, k)))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            h = tf.nn.relu(tf.matmul(x, w))
            loss = tf.reduce_sum(h * h) + tf.reduce_sum(tf.matmul(h, w))  # h used twice: its gradient is a sum
        return tape.gradient(loss, [x, w])

    graph = _graph(step, tf.TensorSpec((b, k)))
    assert measure.saved_activation_bytes(graph) == 4 * 2 * b * k  # x (for dw) and h (ReluGrad, dw, h*h), not AddN
