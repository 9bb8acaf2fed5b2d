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
