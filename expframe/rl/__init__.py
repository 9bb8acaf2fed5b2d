"""Reinforcement learning pieces: environments, replay, n-step adders, actors, losses.

  environments.py   DeepMind Control Suite tasks, flat state observations (`control_suite`)
  pixels.py         the same tasks observed through rendered, stacked frames (`control_suite.pixels`)
  rendering.py      headless rendering in a worker process (EGL, else OSMesa), without TensorFlow
  frame_replay.py   prioritised replay that stores each frame once, stacks rebuilt by index
  experience.py     transitions (state features) or frames (pixels): replay, adders, what actors send
  frame_strip.py    `python -m expframe.rl.frame_strip`: a PNG of frames a pixel agent saw
  sum_tree.py       proportional sampling in O(log n)
  replay.py         prioritised replay with a capacity bound
  adders.py         n-step transitions from episodes
  actors.py         a noisy policy acting in an environment, feeding replay
  rpc.py            the learner's RPC service for actor processes: weights out, transitions in
  actor_process.py  an actor process (`python -m expframe.rl.actor_process`) fed over RPC
  actor_pool.py     the learner's K actor processes: start, watch, restart, stop
  learner_input.py  replay samples as a tf.data input
  losses.py         categorical projection, distributional TD, deterministic policy gradient
"""
